"""CI smoke runs of the bench scripts (``--smoke``: tiny sizes), so they do not rot.

Each script runs as a user would run it, in its own process, against its own scratch
directories. Only that it finished, wrote its JSON, table and PNG, left nothing behind,
and that the figures are well-formed is checked: never how fast anything was.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# A smoke run starts a dozen Python processes; on a busy 2-core machine that takes a while.
pytestmark = pytest.mark.timeout(300)


def run_smoke(script: str, tmp_path: Path, shm_root: Path, *extra: str) -> dict[str, Any]:
    results, disk = tmp_path / "results", tmp_path / "disk"
    argv = [
        sys.executable,
        str(BENCH / script),
        "--smoke",
        "--results-dir",
        str(results),
        "--out-dir",
        str(disk),
        "--shm-dir",
        str(shm_root),
        *extra,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    name = script.removesuffix(".py")
    data: dict[str, Any] = orjson.loads((results / f"{name}.json").read_bytes())
    assert (results / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
    assert (results / f"{name}.md").read_text().count("|") > 10  # the tables
    assert "| " in done.stdout  # ... also printed
    assert list(disk.iterdir()) == [], "scratch left on the disk"
    assert list(shm_root.iterdir()) == [], "scratch left in /dev/shm"
    assert data["smoke"] is True
    assert data["machine"]["cores"] >= 1
    return data


def positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_throughput_smoke(tmp_path: Path, shm_root: Path) -> None:
    data = run_smoke("throughput.py", tmp_path, shm_root)
    workload = data["workload"]
    assert workload["samples"] >= 1
    assert workload["bytes"] == workload["tokens"] * data["row_bytes"]
    assert {r["method"] for r in data["raw"]} == {
        "sendfile",
        "O_DIRECT from mmap",
        "read + O_DIRECT, huge-page buffer",
    }
    assert sum(r["named"] for r in data["raw"]) == 2  # the durable-name variants
    for row in data["raw"]:
        assert row["bytes"] == workload["bytes"]
        assert positive(row["gb_per_s"]) and positive(row["seconds"])
    assert [r["name"] for r in data["hsx"]] == ["hsx, prefab server", "hsx, fake server"]
    for row in data["hsx"]:
        assert row["samples"] == workload["samples"]
        assert row["tokens"] == workload["tokens"]
        assert row["bytes"] > workload["bytes"]  # hidden states plus headers and ids
        assert positive(row["gb_per_s"]) and positive(row["cpu_s"]) and positive(row["peak_rss_mb"])
    assert positive(data["fake_alone"]["gb_per_s"])
    raw_nosync, hsx_nosync = data["nofsync"]
    assert raw_nosync["sync"] is False and hsx_nosync["samples"] == workload["samples"]
    idle, *memory = data["memory"]
    assert idle["samples"] == 0 and positive(idle["cpu_s"])
    assert [m["samples"] for m in memory] == [32, 2]
    assert all(positive(m["peak_rss_mb"]) for m in memory)
    assert data["best_raw"] in {r["name"] for r in data["raw"]}
    assert data["best_raw_named"] in {r["name"] for r in data["raw"] if r["named"]}
    paired = data["paired"]
    assert [p["hsx_first"] for p in paired["pairs"]] == [False, True]  # the order alternates
    assert [p["order"] for p in paired["pairs"]] == [["raw", "hsx"], ["hsx", "raw"]]
    assert len(paired["idle_cpu_s_runs"]["hsx"]) == 2  # an empty run before and after
    for p in paired["pairs"]:
        assert positive(p["raw_gb_per_s"]) and positive(p["hsx_gb_per_s"])
        assert p["ratio"] == p["hsx_gb_per_s"] / p["raw_gb_per_s"]
        # the paired phase's own empty runs' CPU off
        net = (p["hsx_cpu_s"] - paired["idle_cpu_s"]["hsx"]) / (p["bytes"] / 1e9)
        assert p["hsx_cpu_s_per_gb_net"] == pytest.approx(net)
        # The copy window starts at the admission, inside the run: a higher rate.
        assert p["ratio_copy"] > p["ratio"]
        # hsx's own count of its run's CPU: some, and less than the whole process's.
        assert 0 < p["hsx_cpu_s_per_gb_run"] < p["hsx_cpu_s"] / (p["bytes"] / 1e9)
        assert p["cpu_over_raw_run"] == p["hsx_cpu_s_per_gb_run"] / p["raw_cpu_s_per_gb"]
        assert p["raw_delete_cpu_s_per_gb"] >= 0
        # The copy's own CPU: the in-run CPU less a one-sample run's (its fixed cost).
        fixed = paired["fixed_run_cpu_s"]["hsx"]
        own = p["hsx_cpu_s_per_gb_run"] - fixed / (p["bytes"] / 1e9)
        assert p["hsx_cpu_s_per_gb_copy"] == pytest.approx(own)
        assert own < p["hsx_cpu_s_per_gb_run"]
        assert p["cpu_over_raw_copy"] == pytest.approx(own / p["raw_cpu_s_per_gb"])
        consumer = p["raw_cpu_s_per_gb"] + p["raw_delete_cpu_s_per_gb"]
        assert p["cpu_over_raw_consumer_copy"] == pytest.approx(own / consumer)
    # ... measured by a one-sample run before and after the pairs, which counts some CPU
    assert len(paired["fixed_run_cpu_s_runs"]["hsx"]) == 2 and positive(fixed)
    lo, hi = paired["quartiles"]
    assert lo <= paired["median_ratio"] <= hi
    lo, hi = paired["quartiles_copy"]
    assert lo <= paired["median_ratio_copy"] <= hi
    assert positive(paired["cpu_over_raw_run_median"])


def test_throughput_pairs_hsx_with_the_raw_copy_asked_for(tmp_path: Path, shm_root: Path) -> None:
    method, logs = "O_DIRECT from mmap", tmp_path / "logs"
    data = run_smoke(
        "throughput.py", tmp_path, shm_root, "--phases", "paired", "--pair-method", method,
        "--keep-logs", str(logs),
    )  # fmt: skip
    paired = data["paired"]
    assert paired["raw_method"] == f"raw {method} ×1"
    assert len(paired["pairs"]) == 2
    assert all(positive(p["raw_gb_per_s"]) and positive(p["ratio"]) for p in paired["pairs"])
    # --keep-logs: every hsx run's debug log, which bench/timeline.py reads
    kept = sorted(p.name for p in logs.iterdir())
    assert {"pair-0-1.log", "pair-1-1.log", "idle-0-0.log", "fixed-0-1.log"} <= set(kept)
    done = subprocess.run(
        [sys.executable, str(BENCH / "timeline.py"), str(logs / "pair-0-1.log")],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    shown = [line.split() for line in done.stdout.splitlines()[1:]]
    names = [row[2] for row in shown]
    assert names[0] == "run_started" and float(shown[0][0]) == 0.0
    assert names[-1] == "run_finished" and float(shown[-1][0]) > 0
    assert "server_admitted" in names and "sample_done" in names
    assert names.count("sample_done") == paired["pairs"][0]["samples"]


def test_throughput_pairs_another_checkout_in_every_pair(tmp_path: Path, shm_root: Path) -> None:
    """``--compare-src``: a second hsx (here the same tree) in each pair, the order of the
    three members changing from pair to pair (the dumps written again after each hsx)."""
    repo = BENCH.parent
    data = run_smoke(
        "throughput.py", tmp_path, shm_root, "--phases", "paired", "--pairs", "3",
        "--compare-src", str(repo), "--compare-name", "other",
    )  # fmt: skip
    paired = data["paired"]
    assert [c["name"] for c in paired["clients"]] == ["hsx", "other"]
    orders = [p["order"] for p in paired["pairs"]]
    assert orders == [["hsx", "raw", "other"], ["other", "raw", "hsx"], ["raw", "hsx", "other"]]
    for p in paired["pairs"]:
        other = p["others"]["other"]
        assert positive(other["hsx_gb_per_s"]) and positive(other["ratio"])
        net = (other["hsx_cpu_s"] - paired["idle_cpu_s"]["other"]) / (other["bytes"] / 1e9)
        assert other["hsx_cpu_s_per_gb_net"] == pytest.approx(net)
    assert positive(paired["others"]["other"]["hsx_over_it_median"])


def test_scaling_smoke(tmp_path: Path, shm_root: Path) -> None:
    data = run_smoke("scaling.py", tmp_path, shm_root)
    assert positive(data["model_capacity"])
    assert [p["concurrency"] for p in data["points"]] == [1, 4]
    for row in [*data["points"], data["baseline"], data["ceiling"]]:
        assert positive(row["tokens"]) and positive(row["run_tokens_per_s"])
        assert row["steady_tokens_per_s"] >= 0
        assert 0 < row["mean_pass_fill"] <= 1
    assert data["baseline"]["samples"] >= 1
    assert data["summary"]["best_concurrency"] in (1, 4)
    auto = data["auto"]
    assert auto["concurrency"] == "auto" and positive(auto["tokens"])
    assert auto["settled_tokens_per_s"] >= 0
    assert all(c["reason"] for c in auto["changes"])


def test_overhead_smoke(tmp_path: Path, shm_root: Path) -> None:
    data = run_smoke("overhead.py", tmp_path, shm_root)
    assert data["idle"]["samples"] == 0
    assert [r["name"] for r in data["runs"]] == ["hsx c4"]
    for row in data["runs"]:
        assert row["samples"] == 40
        assert positive(row["requests_per_s"]) and positive(row["cpu_s"])
    assert positive(data["null"]["requests_per_s"])
    assert len(data["file_floor"]) == 3
    for row in data["file_floor"]:
        assert row["files"] == 40 and positive(row["files_per_s"])


def test_transport_smoke(tmp_path: Path, shm_root: Path) -> None:
    """hsx serve plain, with its secret and with secret + TLS, side by side in one run."""
    data = run_smoke("transport.py", tmp_path, shm_root)
    methods = [r["method"] for r in data["rows"]]
    modes = ("plain", "secret", "secret+TLS")
    assert sorted(methods) == sorted(
        [f"local ×{n}" for n in (1, 2)] + [f"hsx serve {m} ×{n}" for m in modes for n in (1, 2)]
    )
    for row in data["rows"]:
        assert positive(row["gb_per_s"]) and positive(row["reader_cpu_s_per_gb"])
        if row["method"].startswith("hsx serve"):
            assert positive(row["vs_plain"])
            # serve's CPU at smoke size may be under a clock tick: no ratio then
            cpu_ratio = row["server_cpu_vs_plain"]
            assert cpu_ratio is None or (math.isfinite(cpu_ratio) and cpu_ratio >= 0)
            if "plain" in row["method"]:
                assert row["vs_plain"] == 1 and cpu_ratio in (None, 1)
        else:
            assert row["vs_plain"] is None


def test_online_smoke(tmp_path: Path, shm_root: Path) -> None:
    data = run_smoke("online.py", tmp_path, shm_root)
    rows = data["rows"]
    assert [r["phase"] for r in rows] == [
        "alone", "consumer 2x, limit", "consumer 0.5x, limit", "consumer 0.5x, no limit",
    ]  # fmt: skip
    limit = data["spool_limit"]
    assert limit >= data["file_bytes"] and rows[0]["vs_alone"] == 1.0
    for row in rows:
        assert row["samples"] == data["workload"]["samples"]
        assert positive(row["rate"]) and positive(row["vs_alone"]) and positive(row["peak_spool"])
        assert row["timeline"], "the spool was never looked at"
    for row in rows[1:]:  # every sample reached the consumer, who acknowledged them all
        assert row["consumed"] == row["samples"] and positive(row["consumer_rate"])
        assert row["peak_lag"] >= 1 and row["timeline"][-1][2] == 0
        assert positive(row["check_vs_measured"])  # hsx check's model, for the same phase
    for row in rows[1:3]:  # the limit holds, on the disk (temp files included)
        assert row["spool_limit"] == limit and row["peak_spool"] <= limit
    assert rows[3]["spool_limit"] == 0


def test_baseline_serial_copies_every_sample(tmp_path: Path, shm_root: Path) -> None:
    """The serial baseline on its own: every sample's parts end up in one file each."""
    from hsx_async.protocol import row_bytes

    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    model = common.Model(hidden_size=64, aux_layers=(1, 3, 5))
    lengths = [3, 40, 1]
    samples = tmp_path / "in.jsonl"
    common.write_samples(samples, lengths)
    out = tmp_path / "out"
    argv = common.fake_server_argv(model, shm_root)
    with common.ServerProcess(argv, tmp_path / "server.log") as server:
        done = subprocess.run(
            [sys.executable, str(BENCH / "baseline_serial.py"), "--url", server.url,
             "--input", str(samples), "--out", str(out), "--dump-root", str(shm_root)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = orjson.loads(done.stdout.strip().splitlines()[-1])
    per_token = row_bytes(64, (1, 3, 5))
    assert result["samples"] == 3 and result["tokens"] == sum(lengths)
    assert result["bytes"] == sum(lengths) * per_token
    assert sorted(p.stat().st_size for p in out.iterdir()) == sorted(n * per_token for n in lengths)
    assert list(shm_root.iterdir()) == []


def test_profile_summary_shares_by_thread_and_function(tmp_path: Path) -> None:
    profile = tmp_path / "hsx.txt"
    profile.write_text(
        "thread (1): MainThread;run (a.py:1);generate (c.py:5) 6\n"
        # a recursive frame counts once, inclusive
        "thread (1): MainThread;run (a.py:1);generate (c.py:9);generate (c.py:5) 2\n"
        "thread (7): hsx-copy_0;stage (w.py:3) 2\n"
        # start-up is left out
        "thread (1): MainThread;main (hsx_async/cli/__init__.py:46);"
        "build_parser (hsx_async/cli/__init__.py:41);"
        "_find_and_load (<frozen importlib._bootstrap>:1) 5\n"
    )
    script = str(BENCH / "profile_summary.py")
    done = subprocess.run(
        [sys.executable, script, "--top", "2", str(profile)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    lines = [line.strip() for line in done.stdout.splitlines()]
    assert lines[0] == "10 samples"
    assert "80.0%  MainThread" in lines and "20.0%  hsx-copy_0" in lines
    inclusive = lines[lines.index("top 2, inclusive:") + 1 :][:2]
    assert inclusive == ["80.0%  run (a.py)", "80.0%  generate (c.py)"]
    self_time = lines[lines.index("top 2, self:") + 1 :][:2]
    assert self_time == ["80.0%  generate (c.py)", "20.0%  stage (w.py)"]
    only = subprocess.run(
        [sys.executable, script, "--thread", "hsx-copy_0", str(profile)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert only.stdout.splitlines()[0] == "2 samples"


def test_hook_smoke(tmp_path: Path, shm_root: Path) -> None:
    """bench/hook.py: every configuration ran, committed every dump, and the old and new
    paths sit side by side in one result (no timing is asserted)."""
    data = run_smoke("hook.py", tmp_path, shm_root)
    names = [r["mode"] for r in data["rows"]]
    assert len(names) == 8 and sum(r["old"] for r in data["rows"]) == 3
    assert data["shape"]["hidden_size"] == 7168 and data["shape"]["aux_layers"] == [2, 30, 58]
    for row in data["rows"]:
        assert row["committed"] == data["settings"]["passes"] * data["shape"]["requests_per_pass"]
        assert positive(row["sched_ms_per_gb"]) and positive(row["gb_per_s"])
        assert positive(row["peak_rss_mb"])
        assert (row["peak_queued_mb"] > 0) is row["background"]
    ratios = data["speedup_sched_old_over_new"]
    assert set(ratios) == {"glue", "PrefillDumper", "float32 cast (issue 28)"}
    assert all(positive(v) for ratio in ratios.values() for v in ratio.values())


def test_hook_gpu_smoke(tmp_path: Path, shm_root: Path) -> None:
    """bench/hook_gpu.py on the CPU: the device path and the plain path, each with a bf16
    and a float32 model, and FP8 quantized on the device (issue 40), ran through the real
    glue and writers, committed every dump and sit side by side in one result, the first
    passes measured apart; then the writer threads swept (no timing is asserted; on the
    CPU nothing crosses a bus and there is no page-locked memory to warm)."""
    data = run_smoke("hook_gpu.py", tmp_path, shm_root)
    assert data["device"] == "cpu" and data["target_gb_per_s"] == 2.0
    settings, shape = data["settings"], data["shape"]
    assert settings["writers"] == [1, 2] and settings["pinned_warmup"] == "on"
    rows = data["rows"]
    assert [(r["device_stack"], r["dtype"], r["fp8"]) for r in rows] == [
        (False, "bfloat16", False),
        (True, "bfloat16", False),
        (False, "float32", False),
        (True, "float32", False),
        (True, "bfloat16", True),
        (True, "float32", True),
    ]
    passes = settings["passes"] + settings["warmup"]
    for row in rows + data["sweep"]:
        assert row["committed"] == passes * shape["requests_per_pass"]
        assert positive(row["gb_per_s"]) and positive(row["sched_ms_per_gb"])
        assert row["bus_bytes_per_dump_byte"] == 0  # the CPU: async_d2h copies nothing
        # The first passes, apart from the steady ones.
        each = row["first_sched_cpu_ms_per_gb_each"]
        assert row["first_passes"] == settings["warmup"] == len(each)
        assert row["first_worst_sched_cpu_ms_per_gb"] == max(each)
        assert positive(row["first_sched_cpu_ms_per_gb"])
        # No page-locked memory on a CPU-only torch: the warm-up says so, nothing grows.
        assert row["pinned_warmup"] == "no page-locked memory (CPU)"
        assert (row["grown_warmup"], row["grown_first"], row["grown_steady"]) == (0, 0, 0)
        # FP8 passes are quantized on the device (every one), the others never.
        assert row["encoded_passes"] == (passes if row["fp8"] else 0)
    bf16, fp8 = rows[1], rows[4]
    assert fp8["gb"] < bf16["gb"]  # the FP8 sections: fewer bytes for the same rows
    for row in rows[4:]:
        assert positive(row["encode_ms_per_pass"]) and positive(row["top16_ms_per_pass"])
    assert [(r["mode"], r["threads"]) for r in data["sweep"]] == [
        ("device stack, bf16 model", 1),
        ("device stack, bf16 model", 2),
    ]
    assert set(data["ratios"]) == {"bfloat16", "float32"}
    assert all(positive(v) for ratio in data["ratios"].values() for v in ratio.values())


def test_fake_server_smoke(tmp_path: Path, shm_root: Path) -> None:
    """bench/fake_server.py: this checkout's fake server and another checkout's (here the
    same tree), in alternating rounds, each drained by the null client."""
    repo = BENCH.parent
    data = run_smoke("fake_server.py", tmp_path, shm_root, "--compare-src", str(repo))
    assert [r["name"] for r in data["rows"]] == ["this checkout", "other"]
    for row in data["rows"]:
        assert row["rounds"] == 1 and positive(row["gb_per_s"])
        assert positive(row["server_cpu_s_per_gb"])
    assert positive(data["ratio"])


def test_prepare_smoke(tmp_path: Path, shm_root: Path) -> None:
    data = run_smoke("prepare.py", tmp_path, shm_root)
    runs = {r["name"]: r for r in data["runs"]}
    assert set(runs) == {"baseline (no mask, 1 process)", "prepare-w1", "prepare-w2"}
    for r in runs.values():
        assert r["samples"] == data["conversations"] and positive(r["samples_per_s"])
        assert positive(r["cpu_ms_per_sample"])
    # Same input, same template: every run saw the same tokens.
    assert len({r["tokens"] for r in runs.values()}) == 1
    assert all(positive(r["wall_s"]) for r in data["startup"])


def check_fp8_fallback(data: dict[str, Any]) -> None:
    """fp8.py's fake-server phase: the hook path and the client's fallback, both ways."""
    e2e = data["e2e"]
    summary = e2e["summary"]
    fb = data["fallback_e2e"]
    assert fb["lengths"] == {k: e2e["lengths"][k] for k in ("samples", "tokens")}
    for name in ("bf16", "fp8-all hook", "fp8-all fallback", "fp8-aux hook", "fp8-aux fallback"):
        (run,) = fb["runs"][name]
        assert run["samples"] == fb["lengths"]["samples"] and run["quarantined"] == 0
        assert positive(run["samples_per_s"]) and positive(run["cpu_s"])
        where = fb["probes"][name]["quantized_in"]
        if name == "bf16":
            assert where == "none (bfloat16)"
        else:
            assert where == ("server hook" if name.endswith("hook") else
                             "client writer (server dumped bfloat16)")  # fmt: skip
            storage = name.split()[0]
            assert fb["probes"][name]["dumped"] == (
                e2e["probes"][storage]["dumped"] if name.endswith("hook") else "bfloat16"
            )
            bytes_per_token = fb["summary"][name]["hidden_bytes_per_token"]
            assert bytes_per_token == summary[storage]["hidden_bytes_per_token"]
    # The same quantizer on both sides: the fallback's files are the hook path's, byte for byte.
    assert fb["hook_and_fallback_identical"] == {"fp8-all": True, "fp8-aux": True}
    assert set(fb["fallback_over_hook_cpu_per_token"]) == {"fp8-all", "fp8-aux"}
    assert set(fb["fallback_over_hook_cpu_per_token_net_of_import"]) == {"fp8-all", "fp8-aux"}
    assert fb["first_fallback_sample"]["samples"] == 1  # torch's import, measured apart


def test_fp8_smoke(tmp_path: Path, shm_root: Path) -> None:
    """bench/fp8.py: bf16, FP8 "all" and FP8 "aux" ran over the same samples end to end
    through the reference server (its hook quantizing) and through the fake server both
    ways (hook and the client's fallback), the writer phase ran every job, and the quality
    figures, read back through the dataset reader, are well-formed; the exact properties of
    the storage hold (sizes, a kept final state's KL of 0, one quantizer)."""
    data = run_smoke("fp8.py", tmp_path, shm_root)
    teacher = data["teacher"]
    assert teacher["gains"]["min"] < 0.5 and teacher["gains"]["max"] > 2  # not unit gains
    h, layers = teacher["hidden_size"], len(teacher["aux_layers"]) + 1
    e2e = data["e2e"]
    assert e2e["idle"]["samples"] == 0
    for name in ("bf16", "fp8-all", "fp8-aux"):
        (run,) = e2e["runs"][name]
        assert run["samples"] == e2e["lengths"]["samples"] and run["quarantined"] == 0
        assert positive(run["samples_per_s"]) and positive(run["cpu_s"])
    # The reference server's hook quantizes what an FP8 request asks for.
    assert e2e["probes"]["bf16"]["quantized_in"] == "none (bfloat16)"
    for name in ("fp8-all", "fp8-aux"):
        assert e2e["probes"][name]["quantized_in"] == "server hook"
        assert e2e["probes"][name]["meta_protocol"] == 4
    summary = e2e["summary"]
    # The hidden sections' bytes per token, exactly as PROTOCOL §4 lays them out (the
    # default layout: each FP8 vector with a scale and 16 outliers of 2 + 2 bytes).
    vector = h + 4 + 16 * 4
    assert summary["bf16"]["hidden_bytes_per_token"] == layers * h * 2
    assert summary["fp8-all"]["hidden_bytes_per_token"] == layers * vector
    assert summary["fp8-aux"]["hidden_bytes_per_token"] == (layers - 1) * vector + h * 2
    assert summary["fp8-all"]["ratio_bytes"] < summary["fp8-aux"]["ratio_bytes"] < 1
    check_fp8_fallback(data)
    writer = data["writer"]
    assert [s["dataset"] for s in writer["summary"]] == [
        "bf16", "fp8-all", "fp8-all", "fp8-aux", "fp8-aux", "fp8-all-v3", "fp8-all-v3", "fp8-all"
    ]  # fmt: skip
    for s in writer["summary"]:
        assert positive(s["cpu_s_per_gb_written"]) and positive(s["gb_per_s_written"])
    assert writer["hook_and_fallback_identical"] == {
        "fp8-all": True, "fp8-aux": True, "fp8-all-v3": True
    }  # fmt: skip
    quality = data["quality"]
    for name in ("fp8-all", "fp8-aux"):
        q = quality[name]
        assert q["final_state"] == "post_norm" and q["tokens"] > 0
        # Read back through HiddenStateDataset: bf16 as quantize.assemble makes it, raw as stored.
        assert q["reader_equals_assemble"] is True and q["raw_equals_file"] is True
        assert [s["quantized"] for s in q["slots"]] == [True] * (layers - 1) + [name == "fp8-all"]
        for s in q["slots"]:
            if s["quantized"]:
                assert 0.99 < s["cos_min"] <= s["cos_mean"] < 1
                assert 0 < s["rel_rms_mean"] <= s["rel_rms_max"] < 0.1
                assert 0.5 < s["estimated_over_measured"] < 2
            else:
                assert s["rel_rms_max"] == 0 and s["cos_min"] == pytest.approx(1)  # kept
        assert 0 <= q["top1_agreement"] <= 1
    assert quality["fp8-all"]["kl_mean"] > 0
    # The final state kept in bf16: the teacher's logits are those of the bf16 dataset.
    assert quality["fp8-aux"]["kl_exactly_zero"] is True
    assert quality["fp8-aux"]["final_rows_bit_identical"] == 1
    check_fp8_sinks(data["sinks"])


def check_fp8_sinks(sinks: dict[str, Any]) -> None:
    """fp8.py's attention-sink phase: every layout measured on every case; one scale per
    vector starves a sink row's other values, the outliers layout does not."""
    layouts = {"per_token_slot", "per_token_slot_outliers16", "blocks of 128 (not written)",
               "blocks of 32 (not written)"}  # fmt: skip
    syn = sinks["synthetic"]
    assert [c["massive"] for c in syn["cases"]] == [0, 4, 4, 4, 24]
    at_10k = syn["cases"][2]["layouts"]
    assert set(at_10k) == layouts
    assert at_10k["per_token_slot"]["subnormal"] > 0.1  # a fifth at 10,000x
    assert at_10k["per_token_slot_outliers16"]["subnormal"] < 0.005
    assert at_10k["per_token_slot_outliers16"]["outlier_rel_max"] == 0  # kept exact
    assert syn["bytes"]["per_token_slot_outliers16"]["per_vector"] == 7168 + 4 + 64
    forward = sinks["forward"]
    assert [c["ratio"] for c in forward["cases"]] == [0, 1e3, 1e4, 3e4]
    for case in forward["cases"]:
        assert set(case["layouts"]) == layouts
        for figures in case["layouts"].values():
            assert figures["sink"]["rows"] > 0 and figures["ordinary"]["rows"] > 0
            assert 0 <= figures["ordinary"]["kl_mean"] < 1e-2
    assert sinks["verdict"]["layout"] == "per_token_slot_outliers16"


def test_buffer_placement_compares_the_two_buffers_round_by_round(tmp_path: Path) -> None:
    disk, results = tmp_path / "disk", tmp_path / "results"
    argv = [sys.executable, str(BENCH / "buffer_placement.py"), "--smoke",
            "--out-dir", str(disk), "--results-dir", str(results)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode == 2 and "O_DIRECT" in done.stderr:
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    assert done.returncode == 0, done.stderr[-3000:]
    data: dict[str, Any] = orjson.loads((results / "buffer_placement.json").read_bytes())
    assert data["offset_in_huge_page"]["aligned"] == 0
    speeds = data["gb_per_s"]
    assert len(speeds["aligned"]) == len(speeds["kernel"]) == 2
    assert all(positive(v) for side in speeds.values() for v in side)
    pairs = zip(speeds["aligned"], speeds["kernel"], strict=True)
    assert data["ratios"] == [a / k for a, k in pairs]
    assert data["median_ratio"] == statistics.median(data["ratios"])
    assert list(disk.iterdir()) == [], "its file left on the disk"
    assert "aligned / kernel's, median" in done.stdout


def test_fp8_copy_check_compares_the_copy_with_and_without_its_check(
    tmp_path: Path, shm_root: Path
) -> None:
    disk, results = tmp_path / "disk", tmp_path / "results"
    argv = [sys.executable, str(BENCH / "fp8_copy_check.py"), "--smoke", "--out-dir",
            str(disk), "--shm-dir", str(shm_root), "--results-dir", str(results)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    data: dict[str, Any] = orjson.loads((results / "fp8_copy_check.json").read_bytes())
    assert set(data["methods"]) == {"direct", "sendfile"}
    for method in data["methods"].values():
        assert len(method["cpu_ratios"]) == 2
        pairs = zip(method["cpu_s_per_gb"]["checked"], method["cpu_s_per_gb"]["unchecked"],
                    strict=True)  # fmt: skip
        assert method["cpu_ratios"] == [c / u for c, u in pairs]
        assert all(positive(v) for side in method["gb_per_s"].values() for v in side)
    assert list(disk.iterdir()) == [] and list(shm_root.iterdir()) == []
    assert "checked / unchecked" in done.stdout
