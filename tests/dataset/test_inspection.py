"""hsx status / verify / verify --repair, and the CLI's exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsx_async.cli import main
from hsx_async.dataset.inspection import dataset_status, verify_dataset
from hsx_async.dataset.manifest import read_manifest
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.e2e import check_dataset, config_raw, make_config, write_config, write_samples

H, AUX = 64, (1, 3, 5)


async def test_verify_finds_corruption_and_repair_lets_a_rerun_heal(
    tmp_path: Path, shm_root: Path
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 12, max_len=16, bad_every=5)
    async with running_fake_server(
        FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root)
    ) as srv:
        config = make_config(tmp_path, samples.path, [srv.url], shm_root)
        await Daemon(config).run()
        out = config.output.dir
        status = dataset_status(out)
        assert (status.done, status.quarantined, status.remaining) == (len(samples.good), 2, 0)
        assert verify_dataset(out).ok
        victim = read_manifest(out)[3]
        data = bytearray((out / victim.path).read_bytes())
        data[-1] ^= 0xFF  # one flipped bit in the last tensor
        (out / victim.path).write_bytes(bytes(data))
        report = verify_dataset(out)
        assert not report.ok and victim.path in report.problems
        assert "xxh3" in report.problems[victim.path][0]
        assert main(["verify", str(out)]) == 1
        assert main(["verify", str(out), "--repair"]) == 1  # reports, then repairs
        assert verify_dataset(out).ok
        assert len(read_manifest(out)) == len(samples.good) - 1
        summary = await Daemon(config).run()
    assert summary.done == 1
    check_dataset(out, samples, hidden_size=H, num_layers=len(AUX) + 1)


def test_config_error_exits_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = config_raw(
        tmp_path,
        tmp_path / "in.jsonl",
        ["http://127.0.0.1:9"],
        tmp_path / "shm",
        workers={"concurency": 3},
    )
    path = write_config(tmp_path, raw)
    assert main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "workers.concurency" in err and "did you mean 'concurrency'" in err


def test_no_server_exits_3(
    tmp_path: Path, shm_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 2)
    raw = config_raw(
        tmp_path,
        samples.path,
        ["http://127.0.0.1:9"],
        shm_root,
        server={"unreachable_timeout": 0.2},
        daemon={"log_level": "error"},
    )
    assert main(["run", "--config", str(write_config(tmp_path, raw))]) == 3
    assert "no server in rotation" in capsys.readouterr().err


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for command in (
        "run",
        "check",
        "status",
        "verify",
        "merge",
        "demo",
        "export",
        "inspect",
        "fake-server",
        "reference-server",
    ):
        assert command in text, command
