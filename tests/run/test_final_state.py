"""One final-state kind per dataset, enforced by the client on every dump (PROTOCOL §3-4)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from hsx_async.dataset.manifest import read_manifest, read_quarantine
from hsx_async.dataset.provenance import PROVENANCE, read_provenance
from hsx_async.dataset.reader import read_header
from hsx_async.errors import DatasetError
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.e2e import make_config, write_samples


async def test_the_first_dump_sets_the_kind_and_a_server_of_the_other_kind_stops_the_job(
    tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 4, max_len=12, seed=1)
    options = FakeOptions(hidden_size=16, aux_layers=(1, 3, 5), dump_root=shm_root)
    async with running_fake_server(options) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], shm_root, hidden_size=16,
                             workers={"max_attempts": 2})  # fmt: skip
        first = await Daemon(config).run()
        out = config.output.dir
        prov = read_provenance(out)
        assert prov is not None
        assert prov["final_state"] == "post_norm"
        for entry in read_manifest(out):
            assert read_header(out / entry.path).metadata["final_state"] == "post_norm"
        # The same dataset said to hold pre-norm states (as if another hook had made it):
        # the server's first dump shows post-norm, so the job stops before any sample is
        # sent (issue 24) — one dataset holds one kind, whatever --allow-provenance-change.
        prov["final_state"] = "pre_norm"
        (out / PROVENANCE).write_bytes(orjson.dumps(prov))
        more = write_samples(tmp_path / "in.jsonl", 6, max_len=12, seed=1)
        assert more.path == samples.path
        with pytest.raises(DatasetError, match=r"final state is post_norm, not pre_norm"):
            await Daemon(config, allow_provenance_change=True).run()
    assert first.done == 4
    assert read_quarantine(out) == []  # nothing charged, nothing quarantined
    assert len(read_manifest(out)) == 4
    assert read_provenance(out)["final_state"] == "pre_norm"  # type: ignore[index]
