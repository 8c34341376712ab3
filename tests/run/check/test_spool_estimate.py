"""``hsx check``'s spool estimate (issue 29): the spool a job needs from the extraction
and consumption rates, each input named; a spool_limit the rates do not fit is a warning
naming the key; the options' error paths are one line, exit 2."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from hsx_async.cli import build_parser, main
from hsx_async.config import Config, spool_bytes_bound
from hsx_async.run.check.spool_estimate import SpoolRates, spool_lines, spool_need
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from hsx_async.units import eta_text
from tests.e2e import config_raw, make_config, write_config, write_samples

H, AUX = 64, (1, 3, 5)
TOKENS, SAMPLES = 100_000, 1_000  # 100 tokens a sample


def acked(tmp_path: Path, limit: int | str = 0) -> Config:
    output = {"retention": "acked", "consumers": ["trainer"], "spool_limit": limit}
    return make_config(
        tmp_path, tmp_path / "in.jsonl", ["http://127.0.0.1:1"], tmp_path / "dumps",
        output=output, input={"max_tokens": 256},
    )  # fmt: skip


def lines(config: Config, rates: SpoolRates, measured: tuple[float, str] | None = (1e4, "disk"),
          tokens: int = TOKENS) -> list[tuple[str, str, str]]:  # fmt: skip
    return spool_lines(config, samples=SAMPLES, tokens=tokens, measured=measured, rates=rates)


def test_a_consumer_that_keeps_up_needs_what_is_in_flight_and_one_ack_interval(
    tmp_path: Path,
) -> None:
    config = acked(tmp_path)  # workers.concurrency 4
    file = spool_bytes_bound(config, 100)
    need = spool_need(config, samples=SAMPLES, tokens=TOKENS, extraction=1e4, consumer=2e4,
                      ack_interval=3.0)  # fmt: skip
    assert need.backlog == 0 and need.in_flight == 4 * file
    assert need.unacked == int(2e4 * 3.0 * file / 100)  # 60,000 tokens consumed, unacked
    assert need.peak == need.in_flight + need.unacked
    assert need.extraction_s == 10.0 and need.consumer_s == 5.0


def test_the_spool_never_needs_more_than_every_file_of_the_job(tmp_path: Path) -> None:
    config = acked(tmp_path)
    need = spool_need(config, samples=SAMPLES, tokens=TOKENS, extraction=1e4, consumer=2e3,
                      ack_interval=3600.0)  # fmt: skip
    every_file = SAMPLES * spool_bytes_bound(config, 100)
    assert need.in_flight + need.unacked + need.backlog > every_file
    assert need.window == need.peak == every_file
    assert need.job_seconds(every_file) == need.extraction_s == 10.0
    peak = lines(config, SpoolRates(consumer=2e3, ack_interval=3600.0))[1][2]
    assert peak.endswith("; at most every sample file of the job"), peak


def test_a_slower_consumer_leaves_a_backlog_when_extraction_ends(tmp_path: Path) -> None:
    config = acked(tmp_path)
    file = spool_bytes_bound(config, 100)
    need = spool_need(config, samples=SAMPLES, tokens=TOKENS, extraction=1e4, consumer=2.5e3,
                      ack_interval=1.0)  # fmt: skip
    assert need.backlog == int(TOKENS * 0.75 * file / 100)  # a quarter consumed by then
    assert need.consumer_s == 40.0 and need.extraction_s == 10.0


def test_the_inputs_are_named_and_a_limit_that_holds_the_peak_is_ok(tmp_path: Path) -> None:
    out = lines(acked(tmp_path, "1GiB"), SpoolRates(consumer=2e4, ack_interval=3.0))
    assert [level for level, _, _ in out] == ["INFO", "INFO", "OK"]
    assert all(check == "spool" for _, check, _ in out)
    inputs = out[0][2]
    for text in ("extraction ~10,000 tokens/s (measured: bound by the disk)",
                 "consumers ~20,000 tokens/s (given: --consumer-rate)",
                 "every 3 s (--ack-interval)", "1,000 samples", "100,000 tokens"):  # fmt: skip
        assert text in inputs, inputs
    assert "keep up: 2.00x extraction" in out[1][2]
    assert "output.spool_limit 1.0 GiB holds the peak" in out[2][2]


def test_a_limit_below_the_backlog_warns_that_extraction_is_throttled(tmp_path: Path) -> None:
    config = acked(tmp_path, "16MiB")
    rates = SpoolRates(consumer=2.5e3, ack_interval=1.0)
    need = spool_need(config, samples=SAMPLES, tokens=TOKENS, extraction=1e4, consumer=2.5e3,
                      ack_interval=1.0)  # fmt: skip
    assert need.window < 16 << 20 < need.peak  # the case under test
    level, _, text = lines(config, rates)[2]
    assert level == "WARN" and text.startswith("output.spool_limit 16.0 MiB is below"), text
    assert (
        "throttled to the consumers' ~2,500 tokens/s" in text and "raise output.spool_limit" in text
    )
    # Fills at 7,500 tokens/s of bytes from the window up; then 2,500 tokens/s to the end.
    fill = ((16 << 20) - need.window) / (7500 * need.per_token)
    total = fill + (TOKENS - 1e4 * fill) / 2500
    assert fill > 1 and f"(~{eta_text(fill)} in)" in text, (text, fill)
    assert f"takes ~{eta_text(total)} instead of ~{eta_text(10)}" in text, (text, total)
    assert "backlog of" in lines(config, rates)[1][2]


def test_a_limit_below_one_ack_interval_warns_that_intake_waits_on_every_ack(
    tmp_path: Path,
) -> None:
    level, _, text = lines(acked(tmp_path, "1MiB"), SpoolRates(consumer=2e4, ack_interval=600))[2]
    assert level == "WARN" and "output.spool_limit 1.0 MiB cannot hold" in text, text
    assert "acknowledge more often" in text


def test_what_is_missing_is_said(tmp_path: Path) -> None:
    config = acked(tmp_path, "1GiB")
    hint = lines(config, SpoolRates())
    assert len(hint) == 1 and "give --consumer-rate" in hint[0][2]
    unmeasured = lines(config, SpoolRates(consumer=1e3), measured=None)
    assert unmeasured[0][0] == "WARN" and "give --extraction-rate" in unmeasured[0][2]
    given = lines(config, SpoolRates(consumer=1e3, extraction=5e3), measured=None)
    assert "extraction ~5,000 tokens/s (given: --extraction-rate)" in given[0][2]
    empty = lines(config, SpoolRates(consumer=1e3), tokens=0)
    assert empty == [("INFO", "spool", "no tokens to extract: the spool stays empty")]
    no_limit = lines(acked(tmp_path), SpoolRates(consumer=1e3))
    assert no_limit[2][0] == "INFO" and "spool_limit is not set" in no_limit[2][2]


def test_a_job_that_keeps_everything_needs_no_spool_estimate(tmp_path: Path) -> None:
    keep = make_config(tmp_path, tmp_path / "in.jsonl", ["http://127.0.0.1:1"], tmp_path / "d")
    assert lines(keep, SpoolRates()) == []
    (line,) = lines(keep, SpoolRates(consumer=1e3))
    assert line[0] == "INFO" and 'retention = "acked"' in line[2]


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--consumer-rate", "0"], "0 must be a positive number"),
        (["--consumer-rate", "-5"], "-5 must be a positive number"),
        (["--consumer-rate", "fast"], "'fast' is not a number"),
        (["--ack-interval", "inf"], "inf must be a positive number"),
        (["--extraction-rate", "nan"], "nan must be a positive number"),
    ],
)
def test_a_bad_rate_is_one_line_exit_2(
    argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["check", "--config", "x.toml", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"{argv[0]}: {why}"), err


async def test_hsx_check_estimates_the_spool_from_the_measured_rate(
    tmp_path: Path, shm_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 20, max_len=200, seed=5)
    options = FakeOptions(hidden_size=H, aux_layers=AUX, dump_root=shm_root,
                          latency_per_token_us=500.0)  # fmt: skip
    async with running_fake_server(options) as srv:
        raw = config_raw(tmp_path, samples.path, [srv.url], shm_root, input={"max_tokens": 256},
                         output={"retention": "acked", "consumers": ["trainer"],
                                 "spool_limit": "1MiB"})  # fmt: skip
        path = write_config(tmp_path, raw)
        argv = ["check", "--config", str(path), "--consumer-rate", "100", "--ack-interval", "5"]
        code = await asyncio.to_thread(main, argv)
    out = capsys.readouterr().out
    assert code == 0, out  # a warning does not fail the check
    spool = [line for line in out.splitlines() if re.match(r"\w+\s+spool ", line)]
    assert len(spool) == 3, out
    assert re.search(r"extraction ~[\d,]+ tokens/s \(measured: bound by the servers\)", spool[0])
    assert "consumers ~100 tokens/s" in spool[0] and "backlog of" in spool[1]
    assert spool[2].startswith("WARN") and "output.spool_limit 1.0 MiB" in spool[2], out
