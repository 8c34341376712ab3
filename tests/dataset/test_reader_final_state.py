"""The reader says what the final slot holds and converts it on request (issue 26): an
SGLang dataset holds the post-norm final state, a vLLM one the pre-norm state; with
``final_state=`` and ``model=`` the reader yields the other kind, converted exactly as
``hsx export`` converts it (one implementation: ``target.convert_final``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hsx_async.dataset.export import export_dataset, read_export_log, speculators_relpath
from hsx_async.dataset.reader import HiddenStateDataset
from hsx_async.dataset.target import post_from_pre
from hsx_async.errors import DatasetError
from hsx_async.protocol import POST_NORM, PRE_NORM
from tests.dataset.test_export import model_dir
from tests.dataset_factory import write_dataset

H = 64


def test_each_engine_s_kind_is_said_and_kept_by_default(tmp_path: Path) -> None:
    for kind in (POST_NORM, PRE_NORM):
        out = tmp_path / kind
        written = write_dataset(out, num_samples=2, hidden_size=H, final_state=kind)
        ds = HiddenStateDataset(out)
        assert ds.final_state == kind
        assert torch.equal(ds[0]["hidden_states"], written[0].hidden[:, -1])


def test_pre_norm_on_request_is_what_the_speculators_export_writes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    written = write_dataset(out, num_samples=3, hidden_size=H, final_state=POST_NORM)
    model, _ = model_dir(tmp_path / "model", H)
    ds = HiddenStateDataset(out, final_state="pre_norm", model=model)
    assert ds.final_state == PRE_NORM
    export_dataset(out, tmp_path / "spec", fmt="speculators", model=model)
    exported = {
        r.id: load_file(tmp_path / "spec" / speculators_relpath(r.index))["hidden_states"]
        for r in read_export_log(tmp_path / "spec").values()
    }
    for i, sample in enumerate(written):
        final = ds[i]["hidden_states"]
        assert torch.equal(final, exported[str(sample.id)][:, -1])  # bit for bit
        assert not torch.equal(final, sample.hidden[:, -1])  # a realistic gain: it differs
        # and the aux layers are as stored
        k = sample.hidden.shape[1] - 1
        assert torch.equal(ds[i]["aux_hidden_states"], sample.hidden[:, :k].reshape(len(final), -1))


def test_post_norm_from_a_vllm_dataset_applies_the_model_s_norm(tmp_path: Path) -> None:
    out = tmp_path / "out"
    written = write_dataset(out, num_samples=2, hidden_size=H, final_state=PRE_NORM)
    model, weight = model_dir(tmp_path / "model", H)
    ds = HiddenStateDataset(out, final_state="post_norm", model=model)
    assert ds.final_state == POST_NORM
    want = post_from_pre(written[1].hidden[:, -1], weight, 1e-5)
    assert torch.equal(ds[1]["hidden_states"], want)


def test_asking_for_the_stored_kind_needs_no_model(tmp_path: Path) -> None:
    out = tmp_path / "out"
    written = write_dataset(out, num_samples=1, hidden_size=H, final_state=PRE_NORM)
    ds = HiddenStateDataset(out, final_state="pre_norm")
    assert torch.equal(ds[0]["hidden_states"], written[0].hidden[:, -1])


def test_a_conversion_without_its_norm_or_on_raw_storage_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_dataset(out, num_samples=1, hidden_size=H, final_state=POST_NORM)
    with pytest.raises(DatasetError, match=r"holds the post_norm final state.*model=PATH"):
        HiddenStateDataset(out, final_state="pre_norm")
    model, _ = model_dir(tmp_path / "model", H)
    with pytest.raises(ValueError, match='storage="bf16"'):
        HiddenStateDataset(out, final_state="pre_norm", model=model, storage="raw")
    with pytest.raises(ValueError, match="final_state='prenorm'"):
        HiddenStateDataset(out, final_state="prenorm")  # type: ignore[arg-type]
    other, _ = model_dir(tmp_path / "other", 2 * H)
    with pytest.raises(DatasetError, match="hidden size 128, the dataset 64"):
        HiddenStateDataset(out, final_state="pre_norm", model=other)
