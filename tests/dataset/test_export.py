"""``hsx export``: SpecForge and speculators layouts, values, and resumption."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import sys
from pathlib import Path

import orjson
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hsx_async.cli import main
from hsx_async.dataset import export
from hsx_async.dataset.export import (
    DRAFT_CONFIG,
    EXPORT_LOG,
    SPECULATORS_ROWS,
    TOKEN_FREQ,
    assign_indices,
    export_dataset,
    read_export_log,
    specforge,
    specforge_relpath,
    speculators_relpath,
)
from hsx_async.dataset.manifest import MANIFEST
from hsx_async.dataset.target import post_from_pre, pre_from_post
from hsx_async.errors import DatasetError
from hsx_async.units import human_bytes
from tests.dataset_factory import WrittenSample, pipeline_dataset, write_dataset

NUM_LAYERS = 61  # a DeepSeek-V3-sized stack: AUX_LAYERS (2, 30, 58) fit it


def model_dir(
    path: Path,
    hidden_size: int,
    *,
    architecture: str = "LlamaForCausalLM",
    model_type: str = "llama",
    seed: int = 0,
) -> tuple[Path, torch.Tensor]:
    """A target-model directory as the export reads it: config.json and the final norm's
    weight (per-channel gains in [0.2, 3], as trained models have), nothing else."""
    path.mkdir(parents=True)
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "num_hidden_layers": NUM_LAYERS,
        "hidden_size": hidden_size,
        "rms_norm_eps": 1e-5,
    }
    (path / "config.json").write_bytes(orjson.dumps(config))
    weight = torch.rand(hidden_size, generator=torch.Generator().manual_seed(seed)) * 2.8 + 0.2
    save_file({"model.norm.weight": weight.to(torch.bfloat16)}, str(path / "model.safetensors"))
    return path, weight.to(torch.bfloat16).float()


def _by_index(dest: Path) -> dict[int, str]:
    return {r.index: r.id for r in read_export_log(dest).values()}


def _mask(sample: WrittenSample) -> torch.Tensor:
    t = sample.entry.num_tokens
    mask = sample.loss_mask
    return torch.ones(t, dtype=torch.int64) if mask is None else mask.to(torch.int64)


def test_relpaths_match_the_trainers() -> None:
    assert specforge_relpath(0) == "rows_0-2000/data_0.ckpt"
    assert specforge_relpath(4123) == "rows_4000-6000/data_4123.ckpt"
    assert specforge_relpath(5, 2) == "rows_4-6/data_5.ckpt"
    assert speculators_relpath(17) == "hidden_states/hs_17.safetensors"


def test_specforge_export_loads_with_torch_load(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "sf"
    written = write_dataset(src, num_samples=5, hidden_size=32, shards=2)
    result = export_dataset(src, dest, fmt="specforge", file_group_size=2)
    assert (result.total, result.written, result.skipped) == (5, 5, 0)
    assert sorted(p.parent.name for p in dest.rglob("*.ckpt")) == [
        "rows_0-2",
        "rows_0-2",
        "rows_2-4",
        "rows_2-4",
        "rows_4-6",
    ]
    by_id = {str(s.id): s for s in written}
    for index, sample_id in _by_index(dest).items():
        sample = by_id[sample_id]
        path = dest / specforge_relpath(index, 2)
        record = torch.load(path, weights_only=True)
        t, layers, size = sample.hidden.shape
        assert list(record) == ["input_ids", "loss_mask", "aux_hidden_state", "hidden_state"]
        assert record["input_ids"].dtype == torch.int64
        assert torch.equal(record["input_ids"], sample.input_ids)
        assert torch.equal(record["loss_mask"], _mask(sample))
        assert record["hidden_state"].shape == (1, t, size)
        assert record["aux_hidden_state"].shape == (1, t, (layers - 1) * size)
        assert record["hidden_state"].dtype == torch.bfloat16
        assert torch.equal(record["hidden_state"][0], sample.hidden[:, -1])
        assert torch.equal(
            record["aux_hidden_state"][0], sample.hidden[:, :-1].reshape(t, (layers - 1) * size)
        )
        # Compact: the file holds these tensors, not the mapping of the whole sample file.
        assert record["hidden_state"].untyped_storage().nbytes() == t * size * 2
        # SpecForge's own loader: torch.load(path, weights_only=False, mmap=True).
        mapped = torch.load(path, weights_only=False, mmap=True)
        assert torch.equal(mapped["aux_hidden_state"], record["aux_hidden_state"])


def test_speculators_export_loads_with_safetensors(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "spec"
    written = write_dataset(src, num_samples=4, hidden_size=16, loss_mask="alternate")
    model, weight = model_dir(tmp_path / "model", 16)
    result = export_dataset(src, dest, fmt="speculators", model=model)
    assert result.written == 4
    assert result.converted
    by_id = {str(s.id): s for s in written}
    rows = [orjson.loads(line) for line in (dest / SPECULATORS_ROWS).read_bytes().splitlines()]
    assert len(rows) == 4
    for index, sample_id in _by_index(dest).items():
        sample = by_id[sample_id]
        path = dest / speculators_relpath(index)
        loaded = load_file(path)
        assert set(loaded) == {"hidden_states", "token_ids"}
        assert loaded["token_ids"].dtype == torch.int64
        assert torch.equal(loaded["token_ids"], sample.input_ids)
        assert loaded["hidden_states"].dtype == torch.bfloat16
        # The aux layers as stored; the final slot pre-norm: the model's norm of it (what
        # speculators computes) gives back the stored post-norm state within bf16.
        assert torch.equal(loaded["hidden_states"][:, :-1], sample.hidden[:, :-1])
        assert torch.allclose(
            loaded["hidden_states"][:, -1].float(), sample.hidden[:, -1].float() / weight,
            rtol=1e-2, atol=1e-3,
        )  # fmt: skip
        # speculators' ArrowDataset: aux = [:, :-1].flatten(1), verifier last = [:, -1].
        t, layers, size = sample.hidden.shape
        assert loaded["hidden_states"][:, :-1].flatten(1).shape == (t, (layers - 1) * size)
        with safe_open(str(path), framework="pt") as fh:
            assert fh.metadata()["hsx_id"] == sample_id
        row = rows[index]
        assert row["input_ids"] == sample.input_ids.tolist()
        assert row["loss_mask"] == _mask(sample).tolist()
        assert (row["seq_len"], row["hsx_id"]) == (t, sample_id)
    # token_freq.pt as speculators' save_token_frequency_distribution: {id: count} over
    # the tokens under loss_mask == 1, loadable with weights_only=True.
    freq = torch.load(dest / TOKEN_FREQ, weights_only=True)
    want: dict[int, int] = {}
    for sample in written:
        for tok, m in zip(sample.input_ids.tolist(), _mask(sample).tolist(), strict=True):
            if m:
                want[tok] = want.get(tok, 0) + 1
    assert freq == want
    # The Hugging Face datasets directory speculators' ArrowDataset loads.
    datasets = pytest.importorskip("datasets")
    hf = datasets.load_from_disk(str(dest))
    assert len(hf) == 4
    assert hf[0]["input_ids"].dtype == torch.int64
    for index, sample_id in _by_index(dest).items():
        assert torch.equal(hf[index]["input_ids"], by_id[sample_id].input_ids)
        assert hf[index]["seq_len"] == by_id[sample_id].entry.num_tokens
    snippet = orjson.loads((dest / DRAFT_CONFIG).read_bytes())
    assert snippet["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert snippet["hsx"]["speculators_target_layer_ids"] == [2, 30, 58]


def test_post_over_gain_renormed_is_the_post_norm_state() -> None:
    """What speculators computes from the exported slot, norm(post / g), is post again:
    post / g has rms 1 whatever the pre-norm state's scale was."""
    gen = torch.Generator().manual_seed(3)
    pre = torch.randn(64, 256, generator=gen) * torch.linspace(0.1, 40, 64)[:, None]
    gain = torch.rand(256, generator=gen) * 2.8 + 0.2
    post = post_from_pre(pre.to(torch.bfloat16), gain, 1e-5)
    exported = pre_from_post(post, gain)
    again = post_from_pre(exported, gain, 1e-5).float()
    assert ((again - post.float()).norm(dim=-1) / post.float().norm(dim=-1)).max() < 0.01
    # Fed unchanged (the old export), the norm is applied twice: far off.
    twice = post_from_pre(post, gain, 1e-5).float()
    assert ((twice - post.float()).norm(dim=-1) / post.float().norm(dim=-1)).min() > 0.1
    # A zero gain carries nothing after the norm: exported as 0, never inf or nan.
    gain[0] = 0
    assert torch.isfinite(pre_from_post(post, gain).float()).all()


def test_speculators_refuses_a_post_norm_dataset_without_the_model(tmp_path: Path) -> None:
    """The trap: speculators applies the final norm itself, so the stored post-norm state
    fed unchanged trains on a target normed twice. Without --model there is no export."""
    src = tmp_path / "out"
    write_dataset(src, num_samples=2, hidden_size=8)
    with pytest.raises(DatasetError, match="give --model PATH"):
        export_dataset(src, tmp_path / "spec", fmt="speculators")
    assert not (tmp_path / "spec").exists()
    # An old (unconverted) speculators export is not extended either.
    old = tmp_path / "old"
    old.mkdir()
    (old / export.EXPORT_INFO).write_bytes(
        orjson.dumps({"format": "speculators", "file_group_size": 2000, "source": str(src)})
    )
    model, _ = model_dir(tmp_path / "model", 8)
    with pytest.raises(DatasetError, match="post_norm final state"):
        export_dataset(src, old, fmt="speculators", model=model)


def test_specforge_refuses_other_than_three_aux_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "out"
    write_dataset(src, num_samples=2, hidden_size=8, aux_layers=(1, 3, 5, 7))
    code = main(["export", str(src), "--format", "specforge", "--to", str(tmp_path / "sf")])
    err = capsys.readouterr().err
    assert code == 2
    assert "exactly 3 aux layers, the dataset has 4 ([1, 3, 5, 7])" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "sf").exists()


@pytest.mark.parametrize(
    ("architecture", "aux", "ids"),
    [
        ("LlamaForCausalLM", (2, 30, 58), [1, 29, 57]),
        ("DeepseekV3ForCausalLM", (2, 30, 58), [1, 29, 57]),
        ("DeepseekV3ForCausalLM", (3, 31, 59), [3, 31, 59]),
        ("LlamaForCausalLM", (0, 30, 58), None),
    ],
)
def test_draft_config_ids_follow_the_family_rule(
    tmp_path: Path, architecture: str, aux: tuple[int, ...], ids: list[int] | None
) -> None:
    src = tmp_path / "out"
    write_dataset(src, num_samples=1, hidden_size=8, aux_layers=aux)
    model, _ = model_dir(tmp_path / "model", 8, architecture=architecture)
    result = export_dataset(src, tmp_path / "sf", fmt="specforge", model=model)
    snippet = orjson.loads((tmp_path / "sf" / DRAFT_CONFIG).read_bytes())
    assert snippet["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    assert snippet["hsx"]["aux_layers"] == list(aux)
    assert snippet["hsx"]["ids_line"] == result.ids_line
    if ids is None:
        assert "no draft-config ids give layers [0, 30, 58]" in result.ids_line
    else:
        assert f"[{', '.join(map(str, ids))}]" in result.ids_line
    assert not result.converted  # SpecForge reads the post-norm state hsx stores


def test_gemma_style_norms_divide_by_one_plus_w(tmp_path: Path) -> None:
    src = tmp_path / "out"
    written = write_dataset(src, num_samples=1, hidden_size=8)
    model, weight = model_dir(
        tmp_path / "model", 8, architecture="Gemma3ForCausalLM", model_type="gemma3_text"
    )
    export_dataset(src, tmp_path / "spec", fmt="speculators", model=model)
    loaded = load_file(tmp_path / "spec" / speculators_relpath(0))["hidden_states"]
    want = written[0].hidden[:, -1].float() / (1 + weight)
    assert torch.allclose(loaded[:, -1].float(), want, rtol=1e-2, atol=1e-3)


def _state(dest: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(dest)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in dest.rglob("*")
        if p.is_file() and p.name not in (EXPORT_LOG, SPECULATORS_ROWS, DRAFT_CONFIG)
    }


def test_rerun_skips_complete_outputs_and_redoes_the_rest(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "sf"
    write_dataset(src, num_samples=6, hidden_size=16)
    export_dataset(src, dest, fmt="specforge")
    before, indices = _state(dest), _by_index(dest)

    again = export_dataset(src, dest, fmt="specforge")
    assert (again.written, again.skipped) == (0, 6)
    assert _state(dest) == before

    # A lost file, a truncated one and a crash's leftover temporary file.
    (dest / specforge_relpath(1)).unlink()
    (dest / specforge_relpath(4)).write_bytes(b"torn")
    stale = dest / "rows_0-2000" / f"{export.TMP_PREFIX}data_9.ckpt"
    stale.write_bytes(b"partial")
    # ...and samples extracted since: they get indices after the existing ones.
    extra = write_dataset(src, num_samples=2, ids=["a-new", "b-new"], hidden_size=16, seed=50)
    third = export_dataset(src, dest, fmt="specforge")
    assert (third.total, third.written, third.skipped) == (8, 4, 4)
    assert not stale.exists()
    after = _by_index(dest)
    assert {i: after[i] for i in indices} == indices
    assert {after[6], after[7]} == {"a-new", "b-new"}
    for sample in extra:
        index = next(i for i, s in after.items() if s == sample.id)
        record = torch.load(dest / specforge_relpath(index), weights_only=True)
        assert torch.equal(record["hidden_state"][0], sample.hidden[:, -1])
    for index in (1, 4):
        record = torch.load(dest / specforge_relpath(index), weights_only=True)
        assert record["hidden_state"].shape[1] == record["input_ids"].shape[0]


def test_changed_source_samples_are_exported_again(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "spec"
    model, _ = model_dir(tmp_path / "model", 8)
    write_dataset(src, num_samples=3, hidden_size=8, seed=0)
    export_dataset(src, dest, fmt="speculators", model=model)
    shutil.rmtree(src)
    fresh = write_dataset(src, num_samples=3, hidden_size=8, seed=7)
    result = export_dataset(src, dest, fmt="speculators", model=model)
    assert result.written == 3
    for index, sample_id in _by_index(dest).items():
        sample = next(s for s in fresh if s.id == sample_id)
        got = load_file(dest / speculators_relpath(index))["hidden_states"]
        assert torch.equal(got[:, :-1], sample.hidden[:, :-1])


def test_a_failed_write_leaves_no_output_and_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dest = tmp_path / "out", tmp_path / "sf"
    write_dataset(src, num_samples=4, hidden_size=8)
    real = specforge.FORMAT.write
    calls = 0

    def flaky(sample_path: Path, entry: object, conv: object, tmp: Path) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            tmp.write_bytes(b"half a file")
            raise OSError(28, "No space left on device")
        real(sample_path, entry, conv, tmp)  # type: ignore[arg-type]

    flaky_format = dataclasses.replace(specforge.FORMAT, write=flaky)
    monkeypatch.setattr(specforge, "FORMAT", flaky_format)
    with pytest.raises(OSError, match="No space"):
        export_dataset(src, dest, fmt="specforge")
    assert len(read_export_log(dest)) == 2
    assert not list(dest.rglob(f"{export.TMP_PREFIX}*"))
    assert len(list(dest.rglob("*.ckpt"))) == 2
    monkeypatch.undo()
    result = export_dataset(src, dest, fmt="specforge")
    assert (result.written, result.skipped) == (2, 2)


def test_refuses_mixing_formats_and_stale_exports(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "x"
    write_dataset(src, num_samples=3, hidden_size=8)
    export_dataset(src, dest, fmt="specforge")
    model, _ = model_dir(tmp_path / "model", 8)
    with pytest.raises(DatasetError, match="holds a specforge export"):
        export_dataset(src, dest, fmt="speculators", model=model)
    with pytest.raises(DatasetError, match="holds a specforge export"):
        export_dataset(src, dest, fmt="specforge", file_group_size=10)
    manifest = src / f"{MANIFEST}.jsonl"
    manifest.write_bytes(b"".join(manifest.read_bytes().splitlines(keepends=True)[1:]))
    with pytest.raises(DatasetError, match="no longer in the dataset"):
        export_dataset(src, dest, fmt="specforge")
    with pytest.raises(DatasetError, match="unknown export format"):
        export_dataset(src, tmp_path / "y", fmt="eagle")
    with pytest.raises(DatasetError, match="dataset directory itself"):
        export_dataset(src, src, fmt="specforge")


def test_assign_indices_keeps_old_and_appends_new() -> None:
    done = {
        "b": export.ExportRecord(0, "b", "p", 1, "0" * 16),
        "z": export.ExportRecord(3, "z", "p", 1, "0" * 16),
    }
    assert assign_indices(["a", "b", "c", "z"], done) == {"a": 4, "b": 0, "c": 5, "z": 3}


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, dest = tmp_path / "out", tmp_path / "spec"
    write_dataset(src, num_samples=2, hidden_size=8)
    model, _ = model_dir(tmp_path / "model", 8)
    argv = ["export", str(src), "--format", "speculators", "--to", str(dest)]
    assert main([*argv, "--model", str(model)]) == 0
    out = capsys.readouterr()
    assert "exported 2 samples" in out.out
    # Issue 39: a small export said "(0.00 GB)"; sizes are in binary units, as elsewhere.
    written = sum(p.stat().st_size for p in (dest / "hidden_states").glob("hs_*.safetensors"))
    assert f"2 written ({human_bytes(written)})" in out.out and " GB)" not in out.out
    assert "final state converted to pre_norm" in out.out
    assert (
        'LlamaForCausalLM: put "eagle_aux_hidden_state_layer_ids": [1, 29, 57] in the '
        "drafter's config" in out.out
    )
    assert f"--data-path {dest}" in out.out
    assert "--target-layer-ids 2,30,58" in out.out
    assert "2/2 samples" in out.err
    assert len(list((dest / "hidden_states").glob("hs_*.safetensors"))) == 2


def test_speculators_without_the_datasets_extra_is_refused_before_any_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The datasets directory is written last; a missing extra found then would cost the
    whole export (hours on a multi-TB job), so it is refused first, in one line."""
    src, dest = tmp_path / "out", tmp_path / "spec"
    write_dataset(src, num_samples=2, hidden_size=8)
    model, _ = model_dir(tmp_path / "model", 8)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets fails
    argv = ["export", str(src), "--format", "speculators", "--to", str(dest)]
    assert main([*argv, "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "hsx: error: --format speculators writes a Hugging Face datasets directory, and the "
        "datasets package is not installed: pip install -e '.[speculators]' in the hsx clone "
        "(the speculators extra)\n"
    )
    assert not dest.exists()
    # SpecForge needs no extra: the same dataset exports.
    assert export_dataset(src, tmp_path / "sf", fmt="specforge").written == 2


async def test_exports_a_pipeline_dataset(tmp_path: Path, shm_root: Path) -> None:
    written = await pipeline_dataset(tmp_path, shm_root, num_samples=6, seed=8)
    model, _ = model_dir(tmp_path / "model", written.hidden_size)
    export_dataset(written.out_dir, tmp_path / "sf", fmt="specforge")
    export_dataset(written.out_dir, tmp_path / "spec", fmt="speculators", model=model)
    rows = (tmp_path / "spec" / SPECULATORS_ROWS).read_bytes().splitlines()
    for index, sample_id in _by_index(tmp_path / "sf").items():
        ids, hidden, mask = written.expected(sample_id)
        t, k, size = hidden.shape[0], hidden.shape[1] - 1, hidden.shape[2]
        record = torch.load(tmp_path / "sf" / specforge_relpath(index), weights_only=True)
        assert torch.equal(record["input_ids"], ids)
        want_mask = torch.ones(t, dtype=torch.int64) if mask is None else mask.to(torch.int64)
        assert torch.equal(record["loss_mask"], want_mask)
        assert torch.equal(record["hidden_state"], hidden[None, :, -1])
        assert torch.equal(record["aux_hidden_state"], hidden[None, :, :k].reshape(1, t, k * size))
    for index, sample_id in _by_index(tmp_path / "spec").items():
        ids, hidden, mask = written.expected(sample_id)
        loaded = load_file(tmp_path / "spec" / speculators_relpath(index))
        assert torch.equal(loaded["token_ids"], ids)
        assert torch.equal(loaded["hidden_states"][:, :-1], hidden[:, :-1])
        assert orjson.loads(rows[index])["input_ids"] == ids.tolist()


def test_one_export_at_a_time_per_destination(tmp_path: Path) -> None:
    src, dest = tmp_path / "out", tmp_path / "sf"
    write_dataset(src, num_samples=2, hidden_size=8)
    dest.mkdir()
    fd = os.open(dest / export.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(DatasetError, match="another hsx export"):
            export_dataset(src, dest, fmt="specforge")
    finally:
        os.close(fd)
    assert export_dataset(src, dest, fmt="specforge").written == 2
    (dest / export.EXPORT_INFO).write_bytes(b"{torn")
    with pytest.raises(DatasetError, match="not valid JSON"):
        export_dataset(src, dest, fmt="specforge")


def test_an_empty_dataset_exports_to_nothing(tmp_path: Path) -> None:
    src = tmp_path / "out"
    src.mkdir()
    (src / f"{MANIFEST}.jsonl").touch()
    for fmt in ("specforge", "speculators"):
        result = export_dataset(src, tmp_path / fmt, fmt=fmt)
        assert (result.total, result.written) == (0, 0)
        assert result.ids_line == "the dataset is empty: no aux layers to name"
