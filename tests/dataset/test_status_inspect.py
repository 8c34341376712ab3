"""``hsx status`` and ``hsx inspect`` as an operator meets them (issue 17, stumbles 4, 5, 8):
"remaining" after a repair, for shards and merged outputs; exit 2 on what is no dataset;
duplicate ids kept in the quarantine; inspect on a directory or a missing file."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from hsx_async.cli import main
from hsx_async.dataset.inspection import Status, dataset_status
from hsx_async.dataset.manifest import QUARANTINE, read_manifest, read_quarantine
from hsx_async.dataset.merge import merge
from hsx_async.dataset.running import announce
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.dataset_factory import write_dataset
from tests.e2e import make_config, write_samples

H, AUX = 64, (1, 3, 5)


def _options(root: Path) -> FakeOptions:
    return FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=root)


async def test_remaining_after_repair_is_what_the_next_run_writes(
    tmp_path: Path, shm_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 20, max_len=8, bad_every=6, with_duplicates=True)
    async with running_fake_server(_options(shm_root)) as srv:
        config = make_config(tmp_path, samples.path, [srv.url], shm_root)
        await Daemon(config).run()
        out = config.output.dir
        assert dataset_status(out).remaining == 0
        victim = read_manifest(out)[2]
        (out / victim.path).write_bytes(b"corrupt")
        assert main(["verify", str(out), "--repair"]) == 1
        assert dataset_status(out).remaining == 1
        capsys.readouterr()
        assert main(["status", str(out)]) == 0
        assert "remaining:   1 (of 24 input lines)" in capsys.readouterr().out
        summary = await Daemon(config).run()
    assert summary.done == 1
    assert dataset_status(out).remaining == 0


async def test_duplicate_keeps_its_id_and_messages_count_lines_from_one(
    tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 4, max_len=8, with_duplicates=True)
    async with running_fake_server(_options(shm_root)) as srv:
        config = make_config(tmp_path, samples.path, [srv.url], shm_root)
        await Daemon(config).run()
        await Daemon(config).run()  # a resume neither re-quarantines nor skips it wrongly
    out = config.output.dir
    raw = [orjson.loads(x) for x in (out / f"{QUARANTINE}.jsonl").read_bytes().splitlines()]
    assert raw == [
        {
            "id": "s0",
            "line": 4,  # the protocol's 0-based field
            "reason": "duplicate id 's0' (first on line 1)",  # what grep -n says
            "duplicate_of": 0,
            "cause": "sample",  # issue 38: the reason's fields beside its prose
            "kind": "duplicate_id",
            "retriable": False,
        }
    ]
    assert len(read_manifest(out)) == 4 and len(read_quarantine(out)) == 1
    assert main(["verify", str(out)]) == 0  # not "both written and quarantined"


async def test_status_counts_shards_and_merged_outputs(
    tmp_path: Path, shm_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 30, max_len=8, bad_every=7)
    total = len(samples.good) + len(samples.bad_lines)
    together = tmp_path / "together"
    apart = [tmp_path / "s0", tmp_path / "s1"]
    async with running_fake_server(_options(shm_root)) as srv:
        for index in (0, 1):
            for out in (together, apart[index]):
                config = make_config(
                    tmp_path,
                    samples.path,
                    [srv.url],
                    shm_root,
                    output={"dir": str(out)},
                    shard={"index": index, "count": 2},
                )
                await Daemon(config).run()
    status = dataset_status(together)
    assert status.remaining == 0 and sum(status.input_lines.values()) == total
    assert "shards 0/2, 1/2" in status.format()
    one = dataset_status(apart[0])
    assert one.remaining == 0 and list(one.input_lines) == ["0/2"]
    merged = tmp_path / "merged"
    merge(apart, merged)
    capsys.readouterr()
    assert main(["status", str(merged)]) == 0
    text = capsys.readouterr().out
    assert f"remaining:   0 (of {total} input lines, shards 0/2, 1/2)" in text, text


def test_status_of_a_directory_that_is_no_dataset_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not an hsx dataset" in err and err.count("\n") == 1
    assert main(["status", str(tmp_path / "nope")]) == 2


def test_inspect_a_directory_or_a_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "Traceback" not in err
    assert main(["inspect", str(tmp_path / "missing.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "manifest" not in err


def _tree(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.mark.parametrize(
    "command",
    [
        ["verify"],
        ["verify", "--deep"],
        ["verify", "--json"],
        ["export", "--format", "specforge", "--to", "{tmp}/sf"],
        ["export", "--format", "speculators", "--to", "{tmp}/spec"],
    ],
)
@pytest.mark.parametrize("where", ["missing", "empty", "data_dir"])
def test_verify_and_export_of_what_is_no_dataset_exit_2_and_create_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str], where: str
) -> None:
    """Issue 26: `hsx verify nope-out` said "checked 0 files / OK" (exit 0); `hsx export`
    said "exported 0 samples" (exit 0) and created sf/draft-config.json."""
    out = tmp_path / "out"
    write_dataset(out, num_samples=2)
    target = {
        "missing": tmp_path / "nope-out",
        "empty": tmp_path / "empty",
        "data_dir": out / "data",
    }[where]
    if where == "empty":
        target.mkdir()
    before = _tree(tmp_path)
    args = [a.format(tmp=tmp_path) for a in command]
    assert main([args[0], str(target), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hsx: error: "), err
    assert ("is not a directory" if where == "missing" else "is not an hsx dataset") in err
    if where == "data_dir":
        assert f"did you mean {out}?" in err
    assert _tree(tmp_path) == before


async def test_status_of_a_live_run_shows_its_rate_and_eta(tmp_path: Path, shm_root: Path) -> None:
    """Issue 26: `hsx status` on a live run showed counts only; rate and ETA were at
    /status."""
    samples = write_samples(tmp_path / "in.jsonl", 30, max_len=8)
    bound = asyncio.Event()

    class _Watched(Daemon):
        def _http_bound(self, url: str) -> None:
            super()._http_bound(url)
            bound.set()

    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root, latency_base_ms=40)
    async with running_fake_server(options) as srv:
        config = make_config(
            tmp_path, samples.path, [srv.url], shm_root,
            daemon={"metrics_listen": "127.0.0.1:0"}, workers={"concurrency": 1},
        )  # fmt: skip
        daemon = _Watched(config)
        run = asyncio.create_task(daemon.run())
        async with asyncio.timeout(30):
            await bound.wait()
        live = (await asyncio.to_thread(dataset_status, config.output.dir)).format()
        await run
    [line] = [x for x in live.splitlines() if x.startswith("running:")]
    assert "shard 0/1: " in line and " tok/s, " in line and " in flight, ETA " in line, line
    assert f"({daemon.http_url}/status)" in line
    after = (await asyncio.to_thread(dataset_status, config.output.dir)).format()
    assert "running:" not in after
    assert not list(config.output.dir.glob(".hsx-running-*"))


def test_a_killed_runs_status_file_is_ignored(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_dataset(out, num_samples=1)
    announce(out, 0, 1, "http://127.0.0.1:9")  # no process holds shard 0's lock
    assert "running:" not in dataset_status(out).format()


def test_remaining_always_says_of_how_many() -> None:
    """Issue 39: `remaining: 1,455` with nothing to measure it against (a dataset whose
    provenance counted the input samples, before any run read the whole input)."""
    status = Status(done=40, quarantined=5, tokens=0, bytes=0, input_samples=1_500, shards=1)
    assert "remaining:   1,455 (of 1,500 input samples)" in status.format()


def test_status_counts_the_retriable_lines_by_their_field(tmp_path: Path) -> None:
    """Issue 38: whether a line could be retried is its ``retriable`` field, not a prefix
    of its prose (a line written before the fields still counts by its prose)."""
    lines = [
        {"id": "a", "line": 0, "reason": "turn 1: HTTP 500", "cause": "server",
         "kind": "http_5xx", "retriable": True},
        {"id": "b", "line": 1, "reason": "2 attempts failed; last: odd words", "cause": "sample",
         "kind": "bad_input", "retriable": False},
        {"id": "c", "line": 2, "reason": "2 attempts failed; last: HTTP 503"},  # an old line
    ]  # fmt: skip
    (tmp_path / f"{QUARANTINE}.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    status = dataset_status(tmp_path)
    assert (status.quarantined, status.retriable) == (3, 2)
