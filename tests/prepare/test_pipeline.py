"""``hsx prepare`` end to end: files, order, policies, summary, estimate, CLI errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from hsx_async.cli import main
from hsx_async.prepare.encode import EncodeOptions
from hsx_async.prepare.pipeline import FORK_SERVER_PRELOAD, PreparePaths, run_prepare
from hsx_async.run.source import SampleReader
from tests.prepare.conftest import WriteLines

GOOD = {
    "messages": [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "the quick brown fox"},
    ]
}
LONG = {
    "id": "long",
    "messages": [
        {"role": "user", "content": "the quick brown fox"},
        {"role": "assistant", "content": "lazy dog " * 40},
    ],
}


def _records() -> list[object]:
    out: list[object] = []
    for i in range(150):
        if i % 10 == 3:
            out.append(b"not json")
        elif i % 10 == 7:
            out.append({"id": f"r{i}", "messages": [{"role": "user", "content": "no answer"}]})
        else:
            msgs = [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"answer {i} " * (1 + i % 5)},
            ]
            out.append({"id": f"r{i}", "messages": msgs})
    out.append({"id": "r0", **GOOD})  # a duplicate id
    return out


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_outputs_are_in_input_order_and_the_same_for_any_worker_count(
    tmp_path: Path, tokenizer_dirs: dict[str, Path], write_jsonl: WriteLines
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", _records())
    opts = EncodeOptions(tokenizer=tokenizer_dirs["chatml"])
    one = PreparePaths.beside(src, tmp_path / "one" / "samples.jsonl")
    two = PreparePaths.beside(src, tmp_path / "two" / "samples.jsonl")
    s1 = run_prepare(opts, one, workers=1)
    s2 = run_prepare(opts, two, workers=2)
    assert one.out.read_bytes() == two.out.read_bytes()
    assert one.quarantine.read_bytes() == two.quarantine.read_bytes()
    assert s1["samples"] == s2["samples"] == 120 and s1["quarantined"] == 31
    assert s1["records"] == 151
    samples = _lines(one.out)
    assert [s["id"] for s in samples] == [f"r{i}" for i in range(150) if i % 10 not in (3, 7)]
    for s in samples:
        ids, mask = s["input_ids"], s["loss_mask"]
        assert isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask)
    # The samples are valid hsx run input (PROTOCOL §1) with their masks.
    items = list(SampleReader(one.out, 4096).iter_sync())
    assert all(getattr(item, "loss_mask", None) is not None for item in items)
    reasons = {q["line"]: q["reason"] for q in _lines(one.quarantine)}
    assert set(reasons) == {i for i in range(150) if i % 10 in (3, 7)} | {150}
    assert "not JSON" in str(reasons[3]) and "no assistant turn" in str(reasons[7])
    assert "duplicate id 'r0' (first on line 0)" in str(reasons[150])
    assert s1["tokens"] == sum(len(s["input_ids"]) for s in samples)
    assert 0 < s1["trainable_share"] < 1
    assert sum(s1["length_histogram"].values()) == 120
    assert orjson.loads(one.summary.read_bytes()) == s1


def test_the_fork_servers_preload_loads_no_torch() -> None:
    """The workers are forked from a fork server that preloads these modules; a process
    that has loaded torch (AutoTokenizer imports it) must not fork: its workers died."""
    code = "import sys\nfor name in sys.argv[1:]: __import__(name)\nprint('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code, *FORK_SERVER_PRELOAD],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "False"


@pytest.mark.parametrize("policy", ["skip", "truncate"])
def test_max_tokens_policy(
    tmp_path: Path, tokenizer_dirs: dict[str, Path], write_jsonl: WriteLines, policy: str
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD, LONG])
    opts = EncodeOptions(
        tokenizer=tokenizer_dirs["llama3"],
        max_tokens=60,
        length_policy=policy,  # type: ignore[arg-type]
    )
    paths = PreparePaths.beside(src, tmp_path / "s.jsonl")
    summary = run_prepare(opts, paths)
    samples = _lines(paths.out)
    if policy == "skip":
        assert [s["id"] for s in samples] == [samples[0]["id"]] and summary["quarantined"] == 1
        assert "policy skip" in str(_lines(paths.quarantine)[0]["reason"])
    else:
        long = samples[1]
        assert long["id"] == "long" and len(long["input_ids"]) == 60
        assert summary["truncated"] == 1 and summary["longest"] == 60
        assert long["loss_mask"][-1] == 1  # cut inside the answer
        # Token by token, the cut sample is the head of the uncut one.
        whole = PreparePaths.beside(src, tmp_path / "whole.jsonl")
        run_prepare(EncodeOptions(tokenizer=tokenizer_dirs["llama3"]), whole)
        full = _lines(whole.out)[1]
        assert long["input_ids"] == full["input_ids"][:60]
        assert long["loss_mask"] == full["loss_mask"][:60]


def test_estimate_from_the_job_config(
    tmp_path: Path, tokenizer_dirs: dict[str, Path], write_jsonl: WriteLines
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    job = tmp_path / "job.toml"
    job.write_text(
        '[server]\nurls = ["http://127.0.0.1:1"]\n[input]\npath = "samples.jsonl"\n'
        f'[output]\ndir = "{tmp_path / "ds"}"\ndisk_reserve = 0\n'
        "[model]\nhidden_size = 7168\naux_layers = [2, 30, 58]\n"
    )
    out = tmp_path / "samples.jsonl"
    code = main(["prepare", str(src), "--tokenizer", str(tokenizer_dirs["kimi"]),
                 "--out", str(out), "--config", str(job), "--workers", "1"])  # fmt: skip
    assert code == 0
    summary = orjson.loads((tmp_path / "samples.summary.json").read_bytes())
    est = summary["extraction_estimate"]
    assert est["bytes"] == summary["tokens"] * 4 * 7168 * 2
    assert est["layers"] == 4 and est["fits"] is True
    assert summary["max_tokens"] == 32768  # [input].max_tokens's default


def test_system_prompt_options_change_the_rendering(
    tmp_path: Path, tokenizer_dirs: dict[str, Path], write_jsonl: WriteLines
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    tok = str(tokenizer_dirs["chatml"])
    outs = {}
    for name, extra in {
        "plain": [],
        "given": ["--system-prompt", "You are a fox."],
    }.items():
        out = tmp_path / f"{name}.jsonl"
        argv = ["prepare", str(src), "--tokenizer", tok, "--out", str(out), "--workers", "1"]
        assert main([*argv, *extra]) == 0
        outs[name] = _lines(out)[0]
    plain, given = outs["plain"], outs["given"]
    assert plain["input_ids"] != given["input_ids"]
    assert sum(plain["loss_mask"]) == sum(given["loss_mask"])


def test_nothing_is_visible_when_the_run_fails(
    tmp_path: Path, tokenizer_dirs: dict[str, Path], write_jsonl: WriteLines
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    opts = EncodeOptions(tokenizer=tokenizer_dirs["chatml"], chat_template=tmp_path / "none.j2")
    paths = PreparePaths.beside(src, tmp_path / "s.jsonl")
    from hsx_async.errors import ConfigError

    with pytest.raises(ConfigError, match=r"none\.j2"):
        run_prepare(opts, paths)
    assert list(tmp_path.iterdir()) == [src]


def test_cli_errors_are_one_line_and_exit_2(tmp_path: Path, write_jsonl: WriteLines) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    proc = subprocess.run(
        [sys.executable, "-m", "hsx_async", "prepare", str(src), "--tokenizer",
         str(tmp_path / "missing"), "--out", str(tmp_path / "o.jsonl")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "tokenizer" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_sample_exits_1(
    tmp_path: Path, tokenizer_dirs: dict[str, Path], write_jsonl: WriteLines
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [b"[]", b"{}"])
    out = tmp_path / "o.jsonl"
    code = main(["prepare", str(src), "--tokenizer", str(tokenizer_dirs["chatml"]),
                 "--out", str(out), "--workers", "1"])  # fmt: skip
    assert code == 1
    assert len(_lines(tmp_path / "o.quarantine.jsonl")) == 2 and out.read_bytes() == b""


def test_the_summary_is_for_a_person_and_json_on_request(
    tmp_path: Path,
    tokenizer_dirs: dict[str, Path],
    write_jsonl: WriteLines,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 26: hsx prepare printed raw JSON only, with garbled reason keys ("record has
    neither  (ShareGPT) no")."""
    src = write_jsonl(tmp_path / "in.jsonl", [*_records()[:20], {"id": "x", "turns": []}])
    argv = ["prepare", str(src), "--tokenizer", str(tokenizer_dirs["chatml"]), "--workers", "1"]
    assert main([*argv, "--out", str(tmp_path / "a.jsonl")]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"hsx prepare: 16 samples from 21 records → {tmp_path / 'a.jsonl'}")
    assert "% trainable (loss_mask 1)" in text and "{" not in text
    assert f"quarantined: 5 → {tmp_path / 'a.quarantine.jsonl'}" in text
    assert "2  not JSON" in text and "2  no assistant turn" in text
    assert "1  record has neither …" in text, text
    assert f"summary:     {tmp_path / 'a.summary.json'}" in text
    assert main([*argv, "--out", str(tmp_path / "b.jsonl"), "--json"]) == 0
    summary = orjson.loads(capsys.readouterr().out)
    assert summary["samples"] == 16
    assert set(summary["quarantine_reasons"]) == {
        "not JSON", "no assistant turn", "record has neither …",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        (["--workers", "0"], "hsx: error: argument --workers: is 0, expected at least 1"),
        (["--max-tokens", "0"], "hsx: error: argument --max-tokens: is 0, expected at least 1"),
        (
            ["--system", "override"],
            "hsx: error: argument --system override: needs --system-prompt TEXT, the system "
            "prompt to put in every conversation",
        ),
        (["--input-missing"], "hsx: error: argument INPUT: {tmp}/nope.jsonl is not a file"),
        (["--tokenizer-missing"], "hsx: error: argument --tokenizer: {tmp}/no-tok is not a"),
    ],
)
def test_a_bad_argument_is_named_as_an_argument(
    tmp_path: Path,
    *,
    tokenizer_dirs: dict[str, Path],
    write_jsonl: WriteLines,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    expect: str,
) -> None:
    """Issue 26: "config key 'input'" for a CLI argument; --system override without
    --system-prompt was accepted silently."""
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    tok = str(tokenizer_dirs["chatml"])
    if extra == ["--input-missing"]:
        src, extra = tmp_path / "nope.jsonl", []
    if extra == ["--tokenizer-missing"]:
        tok, extra = str(tmp_path / "no-tok"), []
    out = tmp_path / "o.jsonl"
    assert main(["prepare", str(src), "--tokenizer", tok, "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expect.format(tmp=tmp_path)) and err.count("\n") == 1, err
    assert "config key" not in err
    assert not out.exists()
