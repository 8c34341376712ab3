"""``hsx check``: each check on its own, against real files, a real tmpfs and the fake
server."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest

from hsx_async.cli import main
from hsx_async.dataset.manifest import QuarantineEntry
from hsx_async.protocol import PROTOCOL_VERSION
from hsx_async.run.check import preflight
from hsx_async.run.check.preflight import (
    Report,
    check_dump_root,
    check_input,
    check_metrics,
    check_output,
    check_servers,
)
from hsx_async.run.dumps.mounts import fs_type, mount_of
from hsx_async.server.fake.server import running_fake_server
from tests.crash_driver import fake_options
from tests.e2e import config_raw, make_config, shm_leftovers, write_config, write_samples


def _levels(report: Report, check: str) -> list[str]:
    return [level for level, name, _ in report.lines if name == check]


def test_input_counts_tokens_and_the_lines_that_would_be_quarantined(tmp_path: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 12, max_len=16, bad_every=4)
    config = make_config(tmp_path, samples.path, ["http://127.0.0.1:1"], tmp_path / "shm")
    report = Report()
    tokens = check_input(config, report).tokens
    want = sum(len(s["input_ids"]) for s in samples.good.values())
    assert tokens == want
    (level, _, detail), *first_bad = report.lines
    assert level == "WARN"
    # then the first lines that would be quarantined, numbered from 1
    assert first_bad and all(line[0] == "WARN" and " line " in f" {line[2]}" for line in first_bad)
    assert f"{len(samples.good)} samples, {want:,} tokens; {len(samples.bad_lines)} lines" in detail


def test_missing_input_fails_the_check(tmp_path: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    config = make_config(tmp_path, samples.path, ["http://127.0.0.1:1"], tmp_path / "shm")
    samples.path.unlink()
    report = Report()
    assert check_input(config, report).tokens == 0
    assert report.failed and _levels(report, "input") == ["FAIL"]


@pytest.mark.parametrize("content", [b"", b"\n\n  \r\n"], ids=["empty", "blank"])
def test_an_input_with_no_sample_fails_the_check_in_hsx_runs_words(
    tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39: hsx check said "OK input 0 samples" and hsx run wrote 0 samples, exit 0."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(content)
    raw = config_raw(tmp_path, path, ["http://127.0.0.1:9"], tmp_path / "shm")
    config = write_config(tmp_path, raw)
    assert main(["check", "--config", str(config)]) == 1
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.split()[1:2] == ["input"]]
    words = f"input.path {path} holds no sample (the file is empty or blank)"
    assert line.startswith("FAIL") and words in line
    assert main(["run", "--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith(f"hsx: error: {words}")


def test_the_benchs_empty_run_alone_may_have_an_empty_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/ times hsx run's start-up with an input of no sample (child_env sets the
    variable); nothing else gets past the refusal."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"")
    config = make_config(tmp_path, path, ["http://127.0.0.1:9"], tmp_path / "shm")
    assert "holds no sample" in preflight.operator_problem(config)
    monkeypatch.setenv(preflight.BENCH_EMPTY_INPUT, "1")
    assert preflight.operator_problem(config) == ""
    path.unlink()  # the other input checks still hold
    assert "cannot read input.path" in preflight.operator_problem(config)


def _settle(out: Path, ids: list[str]) -> None:
    """Those samples quarantined in ``out``: done, for a resumed run as for the check."""
    out.mkdir(exist_ok=True)
    lines = [QuarantineEntry(i, n, "refused: test").to_line() for n, i in enumerate(ids)]
    (out / "quarantine.jsonl").write_bytes(b"".join(lines))


def test_a_resumed_job_is_checked_for_what_is_left(tmp_path: Path) -> None:
    """Issue 39: hsx check on a dataset that holds part of the input sized the whole job."""
    samples = write_samples(tmp_path / "in.jsonl", 6, max_len=8)
    config = make_config(tmp_path, samples.path, ["http://127.0.0.1:1"], tmp_path / "shm")
    _settle(config.output.dir, ["s0", "s1"])
    report = Report()
    scan = check_input(config, report)
    rest = [s for i, s in samples.good.items() if i not in ("s0", "s1")]
    assert (scan.samples, scan.done, scan.finished) == (4, 2, False)
    assert scan.tokens == sum(len(s["input_ids"]) for s in rest)
    assert report.lines[1] == (
        "INFO",
        "input",
        f"2 of them are in {config.output.dir} already: 4 samples, {scan.tokens:,} tokens "
        "left to extract",
    )


def test_a_finished_dataset_is_checked_as_finished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39: hsx check on a finished dataset still sized and timed the whole job, and
    FAILed on servers hsx run would never ask."""
    samples = write_samples(tmp_path / "in.jsonl", 3, max_len=8)
    raw = config_raw(tmp_path, samples.path, ["http://127.0.0.1:9"], tmp_path / "shm")
    _settle(Path(raw["output"]["dir"]), list(samples.good))
    assert main(["check", "--config", str(write_config(tmp_path, raw))]) == 0
    text = capsys.readouterr().out
    assert (
        f"all 3 are in {raw['output']['dir']} already (its manifest or quarantine): hsx run "
        "has nothing left to extract" in text
    )
    assert "job needs ~0 B" in text and "estimate" not in text
    assert "INFO  server         not asked: with nothing left to extract, hsx run asks none" in text


def test_output_reports_free_space_against_the_job(tmp_path: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    config = make_config(tmp_path, samples.path, ["http://127.0.0.1:1"], tmp_path / "shm")
    config.output.dir.mkdir()
    report = Report()
    assert check_output(config, report, need=1) > 0  # a measured write rate
    assert _levels(report, "output") == ["OK"]
    assert not list(config.output.dir.iterdir()), "the probe file is gone"
    too_big = Report()
    check_output(config, too_big, need=1 << 62)
    assert _levels(too_big, "output") == ["FAIL"]


def test_output_that_is_not_a_directory_fails(tmp_path: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    config = make_config(tmp_path, samples.path, ["http://127.0.0.1:1"], tmp_path / "shm")
    config.output.dir.write_text("a file where the dataset should go")
    report = Report()
    assert check_output(config, report, need=1) == 0.0
    ((level, _, detail),) = report.lines
    assert level == "FAIL" and "exists and is not a directory" in detail


def test_a_taken_metrics_port_fails_the_check(tmp_path: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        config = make_config(
            tmp_path, samples.path, ["http://127.0.0.1:1"], tmp_path / "shm",
            daemon={"metrics_listen": listen},
        )  # fmt: skip
        report = Report()
        check_metrics(config, report)
    ((level, _, detail),) = report.lines
    assert level == "FAIL" and f"daemon.metrics_listen {listen} is in use" in detail
    free = Report()
    check_metrics(config, free)  # the holder is gone
    assert _levels(free, "metrics") == ["OK"]
    off = Report()
    check_metrics(
        dataclasses.replace(config, daemon=dataclasses.replace(config.daemon, metrics_listen="")),
        off,
    )
    assert off.lines == []


def test_dump_root_on_tmpfs_passes_and_elsewhere_warns(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    on_shm = make_config(tmp_path, samples.path, ["http://127.0.0.1:1"], shm_root)
    report = Report()
    check_dump_root(on_shm, report)
    if fs_type(shm_root) == "tmpfs":
        assert _levels(report, "dump root") == ["OK"]
        assert "on tmpfs (RAM)" in report.lines[0][2]
    on_disk = make_config(tmp_path, samples.path, ["http://127.0.0.1:1"], tmp_path / "dumps")
    report = Report()
    check_dump_root(on_disk, report)
    if fs_type(tmp_path) != "tmpfs":
        assert _levels(report, "dump root")[0] == "WARN"
        assert "not RAM: slow" in report.lines[0][2]


def test_a_dump_root_on_a_huge_always_tmpfs_warns_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    root = tmp_path / "dumps"
    root.mkdir()
    table = tmp_path / "mounts"
    monkeypatch.setattr(preflight, "mount_of", lambda path: mount_of(path, table))
    config = make_config(tmp_path, samples.path, ["http://127.0.0.1:1"], root)

    def checked(options: str) -> Report:
        table.write_text(f"/dev/vda1 / ext4 rw 0 0\ntmpfs {tmp_path} tmpfs {options} 0 0\n")
        report = Report()
        check_dump_root(config, report)
        return report

    report = checked("rw,size=4g,huge=always")
    assert _levels(report, "dump root") == ["OK", "WARN"] and not report.failed
    assert f"the tmpfs at {tmp_path} is mounted huge=always" in report.lines[1][2]
    assert "remount it with huge=within_size" in report.lines[1][2]
    for fine in ("rw,size=4g,huge=within_size", "rw,size=4g", "rw,huge=never"):
        assert _levels(checked(fine), "dump root") == ["OK"], fine


def test_a_budget_larger_than_the_dump_root_fails(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    config = make_config(
        tmp_path, samples.path, ["http://127.0.0.1:1"], shm_root, dump={"shm_budget": 1 << 60}
    )
    report = Report()
    check_dump_root(config, report)
    assert report.failed
    assert "dump.shm_budget exceeds the free space" in report.lines[-1][2]


async def test_servers_pass_through_the_whole_dump_path(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    async with running_fake_server(fake_options(shm_root)) as fake:
        config = make_config(
            tmp_path, samples.path, [fake.url, "http://127.0.0.1:1"], shm_root,
            server={"request_timeout": 5.0},
        )  # fmt: skip
        report = Report()
        await check_servers(config, report)
    ok, *extra, down = report.lines
    assert ok[0] == "OK" and "healthy" in ok[2] and "dump path OK" in ok[2]
    # then what hsx check adds for a healthy server: the drafter-config ids line
    assert [line[1] for line in extra] == ["draft ids"]
    assert down[0] == "FAIL" and down[2].startswith("http://127.0.0.1:1: ")
    # Classified as a run classifies it (issue 38): the fault's cause and kind.
    assert down[2].endswith("[server fault: unreachable]")
    # The identity a run would admit it as: what it says and what its dump says.
    assert f"model {fake.options.model}" in ok[2] and "version fake-" in ok[2]
    assert f"hook protocol {PROTOCOL_VERSION}, final state" in ok[2]
    assert shm_leftovers(shm_root) == [], "the check request leaves nothing in /dev/shm"


def _tree(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def test_a_check_creates_nothing_and_says_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26: on a box without /nvme, hsx check created /nvme/hsx-out and the dump root
    on the root file system and reported its free space as the job's disk."""
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    out, root = tmp_path / "nvme" / "hsx-out", tmp_path / "shm" / "hsx"
    raw = config_raw(tmp_path, samples.path, ["http://127.0.0.1:9"], root)
    raw["output"]["dir"] = str(out)
    path = write_config(tmp_path, raw)
    before = _tree(tmp_path)
    assert main(["check", "--config", str(path)]) == 1  # the server is down: FAIL
    assert _tree(tmp_path) == before
    text = capsys.readouterr().out
    # The server as a run's examination classifies it: the fault's cause and kind.
    [down] = [line for line in text.splitlines() if "http://127.0.0.1:9" in line]
    assert down.startswith("FAIL") and down.endswith("[server fault: unreachable]")
    [output] = [line for line in text.splitlines() if line.split()[1:2] == ["output"]]
    assert (
        output.startswith("WARN") and f"{out} does not exist: hsx run will create it in " in output
    )
    assert f"in {tmp_path} (on " in output and "mount it first" in output
    assert "durable writes ~" in output  # measured where it would be created, probe gone
    [dump] = [line for line in text.splitlines() if "dump root" in line]
    assert f"{root} does not exist yet (hsx run creates it)" in dump


async def test_the_dump_path_check_removes_the_dump_root_it_needed(
    tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    root = shm_root / "not-yet"
    async with running_fake_server(fake_options(root)) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], root)
        report = Report()
        await check_servers(config, report)
    assert report.lines[0][0] == "OK" and "dump path OK" in report.lines[0][2]
    assert _tree(shm_root) == set()


def test_an_output_dir_that_cannot_be_created_fails_the_check(tmp_path: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    (tmp_path / "file").write_bytes(b"x")
    config = make_config(
        tmp_path, samples.path, ["http://127.0.0.1:1"], tmp_path / "shm",
        output={"dir": str(tmp_path / "file" / "out")},
    )  # fmt: skip
    report = Report()
    check_output(config, report, need=1)
    ((level, _, detail),) = report.lines
    assert level == "FAIL" and f"{tmp_path / 'file'} is not a directory" in detail


@pytest.mark.parametrize("honour", [True, False])
async def test_an_fp8_dataset_is_told_where_its_rows_are_quantized(
    tmp_path: Path, shm_root: Path, honour: bool
) -> None:
    """hsx check sends the FP8 request and says whether the server's hook stored FP8
    itself (OK) or dumped bfloat16 for the client to quantize (WARN, naming the fix)."""
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    options = dataclasses.replace(fake_options(shm_root), honour_storage=honour)
    async with running_fake_server(options) as fake:
        config = make_config(
            tmp_path, samples.path, [fake.url], shm_root, output={"dtype": "float8_e4m3fn"}
        )
        report = Report()
        await check_servers(config, report)
    (line,) = [line for line in report.lines if line[1] == "storage"]
    if honour:
        assert line[0] == "OK"
        assert (
            "the hook stores float8_e4m3fn (slots 0,1,2,3; scales per_token_slot_outliers16) "
            "itself" in line[2]
        )
    else:
        assert line[0] == "WARN" and "the hook dumps bfloat16; the client quantizes" in line[2]
        assert "Deploy this version's hook" in line[2]
    assert shm_leftovers(shm_root) == []


async def test_a_bf16_dataset_gets_no_storage_line(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    async with running_fake_server(fake_options(shm_root)) as fake:
        config = make_config(tmp_path, samples.path, [fake.url], shm_root)
        report = Report()
        await check_servers(config, report)
    assert "storage" not in {line[1] for line in report.lines}


# -- issue 38: hsx check decides as the admission does ------------------------------------


async def test_a_server_whose_dumps_the_copy_refuses_fails_the_check(
    tmp_path: Path, shm_root: Path
) -> None:
    """Its FP8 dumps name an outlier channel past H: before, "dump path OK"; now the
    check runs the copy's checks on its dump and fails with the copy's words."""
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    async with running_fake_server(fake_options(shm_root, bad_outliers=True)) as fake:
        config = make_config(
            tmp_path, samples.path, [fake.url], shm_root, output={"dtype": "float8_e4m3fn"}
        )
        report = Report()
        await check_servers(config, report)
    ((level, what, detail),) = [line for line in report.lines if line[0] != "WARN"]
    assert (level, what) == ("FAIL", "dump path")
    assert "outlier channels are past the hidden size 64" in detail
    assert detail.endswith("[server fault: bad_dump]")
    assert shm_leftovers(shm_root) == []


async def test_two_servers_of_one_model_path_with_other_weights_fail_the_check(
    tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    async with (
        running_fake_server(fake_options(shm_root, model="/m")) as one,
        running_fake_server(fake_options(shm_root, model="/m", weights=3)) as two,
    ):
        config = make_config(tmp_path, samples.path, [one.url, two.url], shm_root)
        report = Report()
        await check_servers(config, report)
    levels = {(line[0], line[1]) for line in report.lines}
    assert ("OK", "server") in levels
    (fail,) = [line for line in report.lines if line[0] == "FAIL"]
    assert fail[1] == "identity" and fail[2].startswith(f"{two.url} serves '/m' with other")
    assert f"other weights than {one.url}" in fail[2] and "its probe's rows differ" in fail[2]
    assert fail[2].endswith("[server fault: identity]")  # the run's words, cause and kind


@pytest.mark.parametrize("both_wrong", [False, True])
async def test_a_disagreement_with_the_config_is_decided_by_every_server(
    tmp_path: Path, shm_root: Path, both_wrong: bool
) -> None:
    """One server reports hidden size 128 beside a right one: that server's fault, naming
    what each said. Both report 128: the config's, one line naming both."""
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8)
    async with (
        running_fake_server(fake_options(shm_root, hidden_size=128)) as wrong,
        running_fake_server(fake_options(shm_root, hidden_size=128 if both_wrong else 64)) as b,
    ):
        config = make_config(tmp_path, samples.path, [wrong.url, b.url], shm_root)
        report = Report()
        await check_servers(config, report)
    (fail,) = [line for line in report.lines if line[0] == "FAIL"]
    if both_wrong:
        assert fail[1] == "config" and "set [model].hidden_size = 128" in fail[2]
        assert f"every server says 128: {wrong.url}, {b.url}" in fail[2]
    else:
        assert fail[1] == "server" and "reports hidden size 128" in fail[2]
        assert f"{b.url} agrees with the config" in fail[2]
        assert ("OK", "server") in {(line[0], line[1]) for line in report.lines}
