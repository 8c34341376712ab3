"""Issue 15: hostile servers and unlucky operators. Each case failed on the code before the
fix (hung, crashed, looped or let two runs share what they must not) and must now fail
only the attempt or refuse to start with one line. A server hostile to every request is
the server's fault (issue 24): it is refused at its first contact, with the reason, the
samples are never charged, and the run exits 3. Every run is bounded in time; servers
listen on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from hsx_async.config import Config
from hsx_async.dataset.manifest import read_manifest, read_quarantine
from hsx_async.errors import ConfigError, DatasetError, DumpError, NoServerError
from hsx_async.protocol import check_response
from hsx_async.run.daemon.daemon import Daemon, RunSummary
from hsx_async.run.dumps import writer as writer_module
from hsx_async.run.dumps.writer import FileWriter
from hsx_async.run.servers.client import MAX_BODY, EngineClient
from hsx_async.run.servers.pool import ServerPool
from tests.e2e import SampleSet, make_config, shm_leftovers, write_samples
from tests.run.dumps.test_writer import ALIGNED, BIG_PARTS, assert_nothing_written, make_case
from tests.run.hostile import AUX, H, Hostile, hostile_server, mounted_tmpfs

RUN_LIMIT = 30.0  # seconds any one daemon run here may take


def _config(tmp: Path, samples: SampleSet, h: Hostile, **overrides: Any) -> Config:
    base: dict[str, Any] = {
        "workers": {"max_attempts": 2, "concurrency": 2},
        "dump": {"timeout": 0.5},
        "server": {"request_timeout": 5.0, "unreachable_timeout": 1.0},
    }
    for section, keys in overrides.items():
        base.setdefault(section, {}).update(keys)
    return make_config(tmp, samples.path, [h.url], h.root, hidden_size=H, aux_layers=AUX, **base)


async def _run(config: Config) -> RunSummary:
    async with asyncio.timeout(RUN_LIMIT):
        return await Daemon(config).run()


async def _refused(config: Config, h: Hostile, reason: str) -> None:
    """The server fails every request (its probes too): never admitted, nothing charged,
    quarantined or written; the run exits 3 with the reason, and the loop never blocked."""
    with pytest.raises(NoServerError, match=reason):
        await _run(config)
    out = config.output.dir
    assert read_manifest(out) == [] and read_quarantine(out) == []
    assert h.requests and all("-probe-" in rid for rid in h.requests)
    assert shm_leftovers(h.root) == []


def _sample_requests(h: Hostile) -> list[str]:
    return [rid for rid in h.requests if "-probe-" not in rid]


def _all_quarantined(config: Config, samples: SampleSet, attempts: int | str, reason: str) -> None:
    out = config.output.dir
    assert read_manifest(out) == []
    quarantined = read_quarantine(out)
    assert sorted(str(q.id) for q in quarantined) == sorted(samples.good)
    for q in quarantined:
        assert re.search(rf"^{attempts} attempts failed; last: .*{reason}", q.reason), q.reason


# --- 1. nothing in a dump is opened in a way that can block -----------------------------


@pytest.mark.timeout(60)
async def test_meta_json_as_a_fifo_fails_the_attempt_not_the_loop(
    tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 3, max_len=8)
    async with hostile_server(Hostile(shm_root, mode="fifo_meta")) as h:
        config = _config(tmp_path, samples, h)
        await _refused(config, h, r"meta\.json is not a regular file")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", ["sendfile", "auto"])
def test_part_swapped_for_a_fifo_after_validation_fails_the_copy(
    shm_root: Path, tmp_path: Path, method: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    case = make_case(shm_root, ALIGNED)
    part = case.job.dump.part_paths()[1]
    part.unlink()
    os.mkfifo(part)
    fw = FileWriter(out, method=method, fsync=False, row_bytes=ALIGNED.row)
    with pytest.raises(DumpError, match="not a regular file"):
        fw.stage(case.job)
    assert_nothing_written(out)


# --- 2. every failure counts against max_attempts ---------------------------------------


async def test_a_dump_that_changes_before_every_copy_is_quarantined(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's DumpError used to re-queue the sample with its count reset: ~630
    requeues in 25 s and no end. Now it is an attempt like any other."""
    real_stage = FileWriter.stage

    def shrink_then_stage(self: FileWriter, job: Any) -> Any:
        first = job.dump.part_paths()[0]
        os.truncate(first, first.stat().st_size - 512)  # as a server still writing would
        return real_stage(self, job)

    monkeypatch.setattr(FileWriter, "stage", shrink_then_stage)
    samples = write_samples(tmp_path / "in.jsonl", 3, max_len=8, seed=2)
    async with hostile_server(Hostile(shm_root)) as h:
        config = _config(tmp_path, samples, h, workers={"max_attempts": 3})
        summary = await _run(config)
    assert (summary.done, summary.quarantined, summary.unfinished) == (0, 3, 0)
    # The server passes its probes (which copy nothing), so the failed copies are charged,
    # never past max_attempts. Settled in a batch when the server's probe passes, a sample
    # may have sent up to two more requests uncharged (the streak that takes a server out
    # is 3) before the verdict came.
    _all_quarantined(config, samples, 3, r"changed after validation")
    assert 9 <= len(_sample_requests(h)) <= 15
    assert len(set(h.requests)) == len(h.requests)  # a requeued sample never reuses a rid
    assert shm_leftovers(shm_root) == []


# --- 3. a part truncated under the copy, on a huge-page tmpfs ---------------------------


@pytest.fixture
def huge_root(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with transparent huge pages (the README's recommended dump root)."""
    with mounted_tmpfs(tmp_path / "huge", "size=64M,huge=within_size") as root:
        yield root


@pytest.mark.parametrize("method", ["sendfile", "auto"])
def test_a_part_truncated_during_the_copy_on_huge_pages_is_a_dump_error(
    huge_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """Truncated after its size was re-checked on the descriptor: before its bytes are
    read (``auto``, the O_DIRECT copy), or after the kernel copied it and before it is
    hashed (``sendfile``). Both used to map the part and raise ValueError (mmap past the
    end) out of the writer; a truncation inside a mapped window could SIGBUS."""
    out = tmp_path / "out"
    out.mkdir()
    case = make_case(huge_root, ALIGNED, parts=BIG_PARTS)
    if method == "auto":
        real_open = writer_module._open_part

        def open_then_truncate(path: Path, expected: int) -> int:
            fd = real_open(path, expected)
            os.truncate(path, expected // 2)
            return fd

        monkeypatch.setattr(writer_module, "_open_part", open_then_truncate)
    else:
        real_sendfile = os.sendfile

        def send_then_truncate(out_fd: int, in_fd: int, offset: int, count: int) -> int:
            sent = real_sendfile(out_fd, in_fd, offset, count)
            if offset + sent == os.fstat(in_fd).st_size:  # the whole part is copied
                # The part's descriptor is read-only: truncate the file it names.
                os.truncate(f"/proc/self/fd/{in_fd}", 4096)
            return sent

        monkeypatch.setattr(os, "sendfile", send_then_truncate)
    fw = FileWriter(out, method=method, fsync=False, row_bytes=ALIGNED.row)
    with pytest.raises(DumpError, match="shrank while it was copied"):
        fw.stage(case.job)
    assert_nothing_written(out)


_TRUNCATE_RACE = """
import os, sys, threading
from pathlib import Path
from hsx_async.errors import DumpError
from hsx_async.run.dumps.writer import FileWriter
from tests.run.dumps.test_writer import ALIGNED, BIG_PARTS, make_case
root, out = Path(sys.argv[1]), Path(sys.argv[2])
outcomes = {"ok": 0, "dump_error": 0}
for i in range(12):
    case = make_case(root / str(i), ALIGNED, parts=BIG_PARTS)
    part = case.job.dump.part_paths()[0]
    cut = threading.Thread(target=os.truncate, args=(part, 4096 * (i + 1)))
    fw = FileWriter(out / str(i), method=sys.argv[3], fsync=False, row_bytes=ALIGNED.row)
    (out / str(i)).mkdir()
    cut.start()
    try:
        fw.stage(case.job)
        outcomes["ok"] += 1
    except DumpError:
        outcomes["dump_error"] += 1
    cut.join()
print(outcomes)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["sendfile", "auto"])
def test_truncations_racing_the_copy_never_kill_the_process(
    huge_root: Path, tmp_path: Path, method: str
) -> None:
    """As a hostile server would: a part truncated at an unknown moment of its copy. In a
    child process, so a SIGBUS shows as its exit status instead of killing the tests."""
    out = tmp_path / "out"
    out.mkdir()
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_RACE, str(huge_root), str(out), method],
        capture_output=True,
        cwd=repo,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr.decode()[-2000:])
    assert "dump_error" in done.stdout.decode()


# --- 4. bounded response bodies ---------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "how"), [("gzip_bomb", "inflates"), ("huge_body", r"announces \d+ bytes")]
)
async def test_a_body_past_the_bound_fails_the_attempt(
    tmp_path: Path, shm_root: Path, mode: str, how: str
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8, seed=3)
    async with hostile_server(Hostile(shm_root, mode=mode)) as h:
        config = _config(tmp_path, samples, h)
        await _refused(config, h, rf"response body {how} past {MAX_BODY} bytes")


async def test_a_health_answer_past_the_bound_is_not_healthy(shm_root: Path) -> None:
    async with (
        hostile_server(Hostile(shm_root, health_mode="gzip_bomb")) as h,
        aiohttp.ClientSession() as session,
    ):
        client = EngineClient(
            session, ServerPool([h.url], health_interval=1, unreachable_timeout=1)
        )
        tracemalloc.start()
        try:
            assert "past" in await client.health(h.url)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # The body inflates to 64 MiB; never much more than the bound is held.
    assert peak < 3 * MAX_BODY + (1 << 20), peak


@pytest.mark.parametrize(
    "meta",
    [
        {"id": "r", "prompt_tokens": 1, "cached_tokens": False},
        {"id": "r", "prompt_tokens": True},
        {"id": "r", "prompt_tokens": 1.0},
        {"id": "r", "prompt_tokens": 1, "cached_tokens": 0.0},
    ],
)
def test_token_counts_must_be_integers_not_booleans(meta: dict[str, Any]) -> None:
    with pytest.raises(DumpError, match=r"prompt_tokens|cached_tokens"):
        check_response({"meta_info": meta}, rid="r", num_tokens=1)


def test_integer_token_counts_pass() -> None:
    check_response({"meta_info": {"id": "r", "prompt_tokens": 1}}, rid="r", num_tokens=1)
    check_response(
        {"meta_info": {"id": "r", "prompt_tokens": 1, "cached_tokens": None}}, rid="r", num_tokens=1
    )


async def test_a_boolean_cached_tokens_refuses_the_server(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8, seed=4)
    async with hostile_server(Hostile(shm_root, mode="cached_false")) as h:
        config = _config(tmp_path, samples, h)
        await _refused(config, h, r"cached_tokens is False")


# --- 5. the shard layout belongs to the output directory --------------------------------


async def _finish(config: Config) -> RunSummary:
    summary = await _run(config)
    assert summary.unfinished == 0
    return summary


@pytest.mark.parametrize(
    ("first", "second", "why"),
    [
        ({"count": 1, "index": 0}, {"count": 2, "index": 1}, r"made by an unsharded run"),
        ({"count": 2, "index": 1}, {"count": 1, "index": 0}, r"made by \[shard\] count = 2"),
        ({"count": 2, "index": 0}, {"count": 3, "index": 2}, r"made by \[shard\] count = 2"),
    ],
)
async def test_a_run_with_another_shard_layout_is_refused(
    tmp_path: Path, shm_root: Path, first: dict[str, int], second: dict[str, int], why: str
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 12, max_len=8, seed=5)
    async with hostile_server(Hostile(shm_root)) as h:
        await _finish(_config(tmp_path, samples, h, shard=first))
        before = _contents(tmp_path / "out")
        with pytest.raises(DatasetError, match=why):
            await _run(_config(tmp_path, samples, h, shard=second))
    assert _contents(tmp_path / "out") == before


def _contents(out: Path) -> list[str]:
    """Every name in the output directory but the lock files (a refused run made its own)."""
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.suffix != ".lock")


async def test_two_layouts_starting_together_one_is_refused(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 12, max_len=8, seed=6)
    async with hostile_server(Hostile(shm_root)) as h:
        a = _config(tmp_path, samples, h, dump={"namespace_prefix": "a"})
        b = _config(
            tmp_path, samples, h, dump={"namespace_prefix": "b"}, shard={"count": 2, "index": 1}
        )
        results = await asyncio.gather(_run(a), _run(b), return_exceptions=True)
    refused = [r for r in results if isinstance(r, DatasetError)]
    assert len(refused) == 1, results
    ok = [r for r in results if isinstance(r, RunSummary)]
    assert len(ok) == 1 and ok[0].unfinished == 0
    ids = [str(e.id) for e in read_manifest(tmp_path / "out")]
    assert len(ids) == len(set(ids))


async def test_a_second_run_with_the_same_dump_namespaces_is_refused(
    tmp_path: Path, shm_root: Path
) -> None:
    """Two jobs on one node, default dump root and prefix: they used to clear and sweep
    each other's namespaces. The second is refused while the first holds them."""
    samples = write_samples(tmp_path / "in.jsonl", 4, max_len=8, seed=7)
    gate = asyncio.Event()
    async with hostile_server(Hostile(shm_root, gate=gate)) as h:
        (tmp_path / "a").mkdir()
        first = asyncio.create_task(_run(_config(tmp_path / "a", samples, h)))
        async with asyncio.timeout(RUN_LIMIT):
            await h.seen.wait()
        (tmp_path / "b").mkdir()
        with pytest.raises(ConfigError, match=r"dump\.namespace_prefix.*another hsx run"):
            await _run(_config(tmp_path / "b", samples, h))
        gate.set()
        summary = await first
    assert (summary.done, summary.unfinished) == (4, 0)
    assert shm_leftovers(shm_root) == []  # the lock file goes with its holder


# --- 7. operator mistakes: one line, exit 2 ---------------------------------------------


def _cli_run(tmp_path: Path, raw_overrides: dict[str, Any], capsys: Any) -> tuple[int, str]:
    from hsx_async.cli import main
    from tests.e2e import config_raw, write_config

    samples = tmp_path / "in.jsonl"
    if not samples.exists():
        samples.write_bytes(b'{"input_ids": [1, 2]}\n')
    raw = config_raw(tmp_path, samples, ["http://127.0.0.1:9"], tmp_path / "shm")
    for section, keys in raw_overrides.items():
        raw[section].update(keys)
    code = main(["run", "--config", str(write_config(tmp_path, raw))])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("input_missing", r"cannot read input\.path .*No such file"),
        ("input_dir", r"cannot read input\.path .*a directory"),
        ("input_dev_zero", r"cannot read input\.path /dev/zero: it is a device"),
        ("input_fifo", r"cannot read input\.path .*a FIFO"),
        ("input_empty", r"input\.path .*empty\.jsonl holds no sample \(the file is empty"),
        ("input_blank", r"input\.path .*empty\.jsonl holds no sample \(the file is empty"),
        ("output_file", r"output\.dir .* exists and is not a directory"),
        ("output_under_file", r"output\.dir .* cannot be created"),
        ("url", r"server\.urls\[0\].*must be http"),
    ],
)
def test_operator_mistakes_are_one_line_and_exit_2(
    tmp_path: Path, capsys: Any, case: str, expect: str
) -> None:
    overrides: dict[str, Any] = {}
    if case == "input_missing":
        overrides = {"input": {"path": str(tmp_path / "nope.jsonl")}}
    elif case == "input_dir":
        overrides = {"input": {"path": str(tmp_path)}}
    elif case == "input_dev_zero":
        overrides = {"input": {"path": "/dev/zero"}}
    elif case == "input_fifo":
        os.mkfifo(tmp_path / "fifo")
        overrides = {"input": {"path": str(tmp_path / "fifo")}}
    elif case in ("input_empty", "input_blank"):
        (tmp_path / "empty.jsonl").write_bytes(b"" if case == "input_empty" else b"\n  \n\t\n")
        overrides = {"input": {"path": str(tmp_path / "empty.jsonl")}}
    elif case == "output_file":
        (tmp_path / "file").write_bytes(b"x")
        overrides = {"output": {"dir": str(tmp_path / "file")}}
    elif case == "output_under_file":
        (tmp_path / "file").write_bytes(b"x")
        overrides = {"output": {"dir": str(tmp_path / "file" / "out")}}
    elif case == "url":
        overrides = {"server": {"urls": ["http://[::1"]}}
    code, err = _cli_run(tmp_path, overrides, capsys)
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert re.search(expect, err), err
    assert not (tmp_path / "out").exists() and not (tmp_path / "shm").exists()


@pytest.fixture
def taken_port() -> Iterator[str]:
    """A loopback port another process listens on (as the first of two runs on one node)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield f"127.0.0.1:{held.getsockname()[1]}"


def test_a_taken_metrics_port_is_one_line_exit_2_before_any_work(
    tmp_path: Path, capsys: Any, taken_port: str
) -> None:
    """Issue 26: a second hsx run on one machine died with a 40-line ExceptionGroup (exit 1)
    after start-up, when its /metrics port was the first run's."""
    code, err = _cli_run(tmp_path, {"daemon": {"metrics_listen": taken_port}}, capsys)
    assert code == 2, err
    assert err == (
        f"hsx: error: daemon.metrics_listen {taken_port} is in use (another hsx run on this "
        'machine?): give each run its own HOST:PORT, or "" for no /metrics and /status'
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "shm").exists()


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1M") as ro:
        yield ro


def test_a_read_only_output_dir_is_one_line_and_exit_2(
    tmp_path: Path, capsys: Any, read_only_dir: Path
) -> None:
    code, err = _cli_run(tmp_path, {"output": {"dir": str(read_only_dir)}}, capsys)
    assert code == 2
    assert re.fullmatch(r"hsx: error: output\.dir .* is not writable: Read-only file system.*", err)


@contextlib.contextmanager
def _dataset(tmp_path: Path, shm_root: Path) -> Iterator[Path]:
    """A finished two-sample dataset (written with the hostile server in normal mode)."""
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8, seed=8)

    async def make() -> None:
        async with hostile_server(Hostile(shm_root)) as h:
            await _finish(_config(tmp_path, samples, h))

    asyncio.run(make())
    yield tmp_path / "out"


def test_verify_repair_with_a_directory_for_a_file_then_run(
    tmp_path: Path, shm_root: Path, capsys: Any
) -> None:
    """It used to rewrite the manifest, then crash; and every later run crashed in orphan
    cleanup. Now both say, in one line, what to remove by hand."""
    from hsx_async.cli import main
    from tests.e2e import config_raw, write_config

    with _dataset(tmp_path, shm_root) as out:
        victim = out / read_manifest(out)[0].path
        victim.unlink()
        victim.mkdir()
        assert main(["verify", str(out), "--repair"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a directory, not a sample file" in err[0], err
        assert len(read_manifest(out)) == 1  # the line was dropped nonetheless
        raw = config_raw(tmp_path, tmp_path / "in.jsonl", ["http://127.0.0.1:9"], shm_root)
        raw["model"] = {"hidden_size": H, "aux_layers": list(AUX)}
        assert main(["run", "--config", str(write_config(tmp_path, raw))]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a directory where a sample file belongs" in err[0], err


def test_the_dataset_reader_names_a_directory_in_a_files_place(
    tmp_path: Path, shm_root: Path
) -> None:
    from hsx_async.dataset.reader import HiddenStateDataset

    with _dataset(tmp_path, shm_root) as out:
        victim = out / read_manifest(out)[0].path
        victim.unlink()
        victim.mkdir()
        ds = HiddenStateDataset(out)
        index = [ds.path(i) for i in range(len(ds))].index(victim)
        with pytest.raises(DatasetError, match="not a regular file; run hsx verify"):
            ds[index]


# --- also seen: an input that grew during a run -----------------------------------------


async def test_an_input_that_grew_resumes_and_a_changed_one_is_refused(
    tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 3, max_len=8, seed=9)
    async with hostile_server(Hostile(shm_root)) as h:
        config = _config(tmp_path, samples, h)
        await _finish(config)
        with samples.path.open("ab") as fh:  # lines appended, as while the run read it
            fh.write(orjson.dumps({"id": "late", "input_ids": [5, 6, 7]}) + b"\n")
        again = await _finish(config)
        assert (again.done, again.skipped) == (1, 3)
        samples.path.write_bytes(samples.path.read_bytes().replace(b"[5,6,7]", b"[5,6,8]"))
        with pytest.raises(DatasetError, match="input differs"):
            await _run(config)


def test_namespace_lock_names_never_collide_across_prefixes() -> None:
    """A lock per base covers every namespace of a run: bases end in '-w', workers are
    digits, so two different bases never make the same namespace."""
    from hsx_async.config import ShardConfig
    from hsx_async.run.pipeline.workers import namespace_base

    def base(prefix: str, index: int, count: int) -> str:
        cfg: Any = type("C", (), {})()
        cfg.dump = type("D", (), {"namespace_prefix": prefix})()
        cfg.shard = ShardConfig(index=index, count=count)
        return namespace_base(cfg)

    assert base("hsx", 0, 1) == "hsx-w"
    assert base("hsx", 0, 2) == "hsx-s0-w"
    assert base("hsx-s0", 0, 1) == base("hsx", 0, 2)  # same namespaces: the same lock


# --- 8. FP8 scales that no quantizer makes (issue 24) ------------------------------------


async def test_a_hook_writing_impossible_fp8_scales_fails_the_attempt(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hook that stores negative scales (impossible under PROTOCOL §3: a sign flip of the
    rows that only ``verify --deep`` used to notice, after the fact) fails the attempt like
    any invalid part: the sample whose every dump has them is quarantined with the reason
    after ``max_attempts``, and nothing of it is written; the others are written."""
    import numpy as np
    import torch

    from hsx_async import quantize
    from hsx_async.server.fake.content import expected_hidden_states
    from hsx_async.server.fake.server import FakeOptions, running_fake_server

    samples = write_samples(tmp_path / "in.jsonl", 4, max_len=40, seed=5)
    bad_ids = [77_777, 5, 6]  # the first token no other sample has (ids < 50,000)
    with samples.path.open("ab") as fh:
        fh.write(orjson.dumps({"id": "negative", "input_ids": bad_ids}) + b"\n")
    layers = len(AUX) + 1
    first_row = expected_hidden_states(bad_ids[:1], H, layers).view(np.int16)
    bad_row = torch.from_numpy(first_row).view(torch.bfloat16)[0]
    real_encode = quantize.encode_rows

    def hostile_encode(rows: torch.Tensor, storage: Any) -> list[torch.Tensor]:
        sections = real_encode(rows, storage)
        if torch.equal(rows[0], bad_row):  # this sample's rows: its scales negated
            sections[1] = sections[1].neg()
        return sections

    monkeypatch.setattr(quantize, "encode_rows", hostile_encode)
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root)
    async with running_fake_server(options) as fake:
        config = make_config(
            tmp_path, samples.path, [fake.url], shm_root, hidden_size=H, aux_layers=AUX,
            output={"dtype": "float8_e4m3fn"}, workers={"max_attempts": 2},
        )  # fmt: skip
        summary = await _run(config)
    assert (summary.done, summary.quarantined, summary.unfinished) == (4, 1, 0)
    out = config.output.dir
    assert sorted(str(e.id) for e in read_manifest(out)) == sorted(samples.good)
    (q,) = read_quarantine(out)
    assert q.id == "negative"
    # Charged as the server shows it works for others, never past max_attempts (issue 24).
    negative = r"^2 attempts failed; last: part-\S+: 12 FP8 scales are negative"
    assert re.search(negative, q.reason), q.reason
    assert shm_leftovers(shm_root) == []
