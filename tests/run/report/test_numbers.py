"""The job report (issue 17): the events log a run keeps, report.json and report.png."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

import orjson
import pytest

from hsx_async import cli
from hsx_async.dataset.events import event_files, read_events
from hsx_async.dataset.live.ledger import ConsumerLog
from hsx_async.dataset.live.owners import OwnerHold
from hsx_async.dataset.live.registry import ACKED, Registry, record_registry
from hsx_async.dataset.live.retire import Retirer
from hsx_async.dataset.manifest import ManifestEntry, read_manifest, read_quarantine
from hsx_async.dataset.provenance import PROVENANCE
from hsx_async.dataset.quarantine import INPUT_KINDS, reason_kind
from hsx_async.run.daemon.daemon import Daemon
from hsx_async.run.report.numbers import (
    PLOT_HINT,
    REPORT_JSON,
    REPORT_PNG,
    build_report,
    write_report,
)
from hsx_async.run.servers.faults import KINDS
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.dataset_factory import write_dataset
from tests.e2e import make_config, write_samples

ROOT = Path(__file__).resolve().parents[3]
H, AUX = 64, (1, 3, 5)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_reason_kind_drops_particulars() -> None:
    assert reason_kind("duplicate id 'a-7' (first on line 4)") == "duplicate id …"
    assert (
        reason_kind("3 attempts failed; last: http://127.0.0.1:9/x: HTTP 503: busy")
        == "retries exhausted: HTTP 503"
    )
    assert reason_kind("4 attempts failed; last: no meta.json in /dev/shm/a/b within 2 s") == (
        "retries exhausted: no meta.json in … within N s"
    )
    assert reason_kind("") == "other"


async def _run_twice(tmp_path: Path, shm_root: Path) -> tuple[Path, Daemon]:
    """A faulty run over two servers, then a resume that finds everything done; the
    output directory and the first run's daemon (what it counted in memory)."""
    samples = write_samples(tmp_path / "in.jsonl", 40, max_len=24, bad_every=9)
    opts = FakeOptions(
        hidden_size=H,
        aux_layers=AUX,
        dump_root=shm_root,
        fault_rate=0.2,
        faults=("http_500", "truncated_part"),
        seed=3,
    )
    async with running_fake_server(opts) as a, running_fake_server(opts) as b:
        config = make_config(
            tmp_path, samples.path, [a.url, b.url], shm_root, workers={"max_attempts": 2}
        )
        first = Daemon(config)
        await first.run()
        await Daemon(config).run()
    return config.output.dir, first


async def test_report_numbers_come_from_the_durable_files(tmp_path: Path, shm_root: Path) -> None:
    out, first = await _run_twice(tmp_path, shm_root)
    failed = first.metrics.totals.attempts_failed
    assert [p.name for p in event_files(out)] == ["events.jsonl"]
    report = build_report(out)
    manifest, quarantine = read_manifest(out), read_quarantine(out)
    assert report["totals"] == {
        "samples": len(manifest),
        "tokens": sum(e.num_tokens for e in manifest),
        "bytes": sum(e.size for e in manifest),
        "retired": 0,
        "quarantined": len(quarantine),
        "input_lines": len((tmp_path / "in.jsonl").read_bytes().splitlines()),
    }
    assert sum(report["quarantine_reasons"].values()) == len(quarantine)
    # issue 38: by the lines' fields (every line of this run has them)
    by_kind = report["quarantine_kinds"]
    assert sum(k["count"] for k in by_kind) == len(quarantine) > 0
    assert {k["kind"] for k in by_kind} <= set(KINDS) | set(INPUT_KINDS)
    assert all(k["cause"] in ("sample", "server") for k in by_kind)
    for k in by_kind:
        assert k["retriable"] == (k["kind"] not in INPUT_KINDS)
    assert failed > 0 and sum(report["retries"].values()) == failed
    # Every request the first run sent, by server, as it counted them (the second sent
    # none). Not "both served": a probe that draws a fault (its rid holds the run's random
    # nonce) keeps a server out until the next round, which a run this short can outlast.
    assert first.servers is not None
    assert report["servers"] == {s.display: s.requests for s in first.servers.servers}
    assert sum(report["servers"].values()) == len(manifest) + failed
    runs = report["runs"]
    assert len(runs) == 2 and [r["outcome"] for r in runs] == ["finished", "finished"]
    assert runs[0]["samples"] == len(manifest) and runs[1]["samples"] == 0
    assert all(p["tokens_per_s"] >= 0 for p in report["rate"])
    assert report["rate"], "start and end lines give at least one rate point"


async def test_write_report_png_and_json(tmp_path: Path, shm_root: Path) -> None:
    pytest.importorskip("matplotlib")
    out, _ = await _run_twice(tmp_path, shm_root)
    json_path, png_path, hint = write_report(out)
    assert (json_path, png_path, hint) == (out / REPORT_JSON, out / REPORT_PNG, "")
    assert png_path is not None and png_path.read_bytes()[:8] == PNG_MAGIC
    data = orjson.loads(json_path.read_bytes())
    fresh = build_report(out)
    data.pop("generated")
    fresh.pop("generated")
    assert data == fresh


async def test_without_matplotlib_json_only_with_a_hint(
    tmp_path: Path, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _ = await _run_twice(tmp_path, shm_root)
    monkeypatch.setitem(sys.modules, "hsx_async.run.report.plot", None)  # import fails
    json_path, png_path, hint = write_report(out)
    assert png_path is None and hint == PLOT_HINT
    # a clone's install line (issue 26: 'hsx_async[plot]' is no name pip finds for a clone)
    assert "pip install -e '.[plot]'" in hint
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(r.startswith("matplotlib") for r in extras["plot"])
    assert json_path.is_file() and not (out / REPORT_PNG).exists()


def _run_dir(out: Path) -> None:
    """An output directory as hsx run leaves it before its first events line."""
    out.mkdir()
    (out / PROVENANCE).write_bytes(b"{}\n")


def test_a_killed_run_keeps_its_last_tick(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run_dir(out)
    base = {"shard": "0/1", "quarantined": 0, "retries": {}, "servers": {"http://s": 3}}
    lines = [
        {"event": "start", "time": 100.0, "samples": 0, "tokens": 0, "bytes": 0, **base},
        {"event": "tick", "time": 101.0, "samples": 2, "tokens": 50, "bytes": 10, **base},
        {"event": "tick", "time": 103.0, "samples": 4, "tokens": 150, "bytes": 20, **base},
    ]
    (out / "events.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    report = build_report(out)
    assert report["runs"][0]["outcome"] == "killed or still running"
    assert [p["tokens_per_s"] for p in report["rate"]] == [50.0, 50.0]
    assert report["servers"] == {"http://s": 3}


@pytest.mark.parametrize("last", ["ended", "killed"])
def test_a_killed_run_is_counted_up_to_what_it_committed(tmp_path: Path, last: str) -> None:
    """Issue 39: per-run counts summed to 1,996 of 2,000: a SIGKILLed run lost what it
    committed after its last tick. The next start's ``before`` (or, for the last run,
    the logs now) gives its whole count."""
    out = tmp_path / "out"
    _run_dir(out)
    entries = [
        ManifestEntry(f"s{i}", f"data/0{i}/s{i}.safetensors", 10, 100, "0" * 16) for i in range(10)
    ]
    (out / "manifest.jsonl").write_bytes(b"".join(e.to_line() for e in entries))
    base = {"shard": "0/1", "quarantined": 0, "retries": {}, "servers": {}}
    zero = {"samples": 0, "tokens": 0, "bytes": 0, "quarantined": 0}
    held = {"samples": 6, "tokens": 60, "bytes": 600, "quarantined": 0}

    def at(event: str, t: float, n: int, **extra: object) -> dict[str, object]:
        return {"event": event, "time": t, "samples": n, "tokens": 10 * n, "bytes": 100 * n,
                **base, **extra}  # fmt: skip

    lines = [
        at("start", 100.0, 0, before=zero),
        at("tick", 101.0, 4),  # then it committed 2 more and was killed
        at("start", 200.0, 0, before=held),
        at("tick", 201.0, 1),
        *([at("end", 202.0, 4, stopped=False, unfinished=0)] if last == "ended" else []),
    ]
    (out / "events.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    runs = build_report(out)["runs"]
    assert [(r["samples"], r["tokens"], r["bytes"]) for r in runs] == [(6, 60, 600), (4, 40, 400)]
    assert sum(r["samples"] for r in runs) == len(entries)


async def test_each_start_line_says_what_the_directory_held(tmp_path: Path, shm_root: Path) -> None:
    out, _ = await _run_twice(tmp_path, shm_root)
    starts = [r for r in read_events(out / "events.jsonl") if r["event"] == "start"]
    held = {
        "samples": len(read_manifest(out)),
        "tokens": sum(e.num_tokens for e in read_manifest(out)),
        "bytes": sum(e.size for e in read_manifest(out)),
        "quarantined": len(read_quarantine(out)),
    }
    assert [s["before"] for s in starts] == [dict.fromkeys(held, 0), held]


def test_a_spell_out_of_rotation_ends_in_its_own_run_and_shard(tmp_path: Path) -> None:
    """The same server in two shards of one job (one directory) and in two runs of one
    shard. Shard 0's first run took it out and ended; its second run admitted it (the
    server_back of an admission: no server_out before it in that run); shard 1 took it
    out, refused it again for the same kind (one spell), then for a new kind (a second),
    and brought it back. Before: one fold over every log that never saw a ``start``, so
    the admissions' server_back ended the spells of the other run and shard."""
    out = tmp_path / "out"
    _run_dir(out)
    counts = {"samples": 0, "tokens": 0, "bytes": 0, "quarantined": 0}

    def log(shard: str, *events: tuple[str, float, str]) -> bytes:
        lines = [
            {"event": e, "time": t, "shard": shard, **counts}
            if e == "start"
            else {"event": e, "time": t, "shard": shard, "server": "http://s", "kind": k,
                  "reason": f"{k} at {t}" if e == "server_out" else ""}
            for e, t, k in events
        ]  # fmt: skip
        return b"".join(orjson.dumps(x) + b"\n" for x in lines)

    (out / "events.shard-00000-of-00002.jsonl").write_bytes(
        log(
            "0/2",
            ("start", 100.0, ""),
            ("server_out", 101.0, "dump_missing"),
            ("start", 110.0, ""),
            ("server_back", 111.0, ""),
        )
    )
    (out / "events.shard-00001-of-00002.jsonl").write_bytes(
        log(
            "1/2",
            ("start", 100.5, ""),
            ("server_back", 100.6, ""),
            ("server_out", 102.0, "unreachable"),
            ("server_out", 103.0, "unreachable"),
            ("server_out", 104.0, "identity"),
            ("server_back", 105.0, ""),
        )
    )
    spells = build_report(out)["servers_out"]
    # Issue 39: the unreachable spell read "not back" though the server came back at 105
    # (refused for a new kind meanwhile): its return ends every spell of that outage.
    assert [(s["kind"], s["reason"], s["back"]) for s in spells] == [
        ("dump_missing", "dump_missing at 101.0", None),
        ("unreachable", "unreachable at 102.0", "1970-01-01T00:01:45+00:00"),
        ("identity", "identity at 104.0", "1970-01-01T00:01:45+00:00"),
    ]


def test_hsx_report_on_a_directory_that_is_no_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rule of status, verify and export (inspection.require_dataset): one line,
    exit 2, nothing written; out/data is told its parent."""
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "is not an hsx dataset" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    out = tmp_path / "out"
    _run_dir(out)
    (out / "data").mkdir()
    assert cli.main(["report", str(out / "data")]) == 2
    assert f"did you mean {out}?" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == ["data", PROVENANCE]


# -- the picture (issue 26; before/after looks in the issue note) ----------------------------


def test_an_all_quarantined_run_draws_its_report(tmp_path: Path) -> None:
    """Conversations fed to hsx run: every line quarantined, no request sent. The servers
    panel divided by 0 requests (ZeroDivisionError: hsx run and hsx report exited 1)."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    out.mkdir()
    base = {"shard": "0/1", "samples": 0, "tokens": 0, "bytes": 0, "retries": {}}
    lines = [
        {"event": "start", "time": 100.0, "quarantined": 0, "servers": {"http://s": 0}, **base},
        {"event": "end", "time": 101.0, "quarantined": 2, "servers": {"http://s": 0}, **base},
    ]
    (out / "events.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    (out / "quarantine.jsonl").write_bytes(
        b'{"id": null, "line": 1, "reason": "not JSON"}\n'
        b'{"id": null, "line": 2, "reason": "not JSON"}\n'
    )
    _, png, _ = write_report(out)
    assert png is not None and png.read_bytes()[:8] == PNG_MAGIC


def test_each_run_is_drawn_apart_from_its_start() -> None:
    from hsx_async.run.report.plot import _segments

    rate = [
        {"run": 0, "t": 1.0, "tokens_per_s": 5.0},
        {"run": 0, "t": 2.0, "tokens_per_s": 7.0},
        {"run": 1, "t": 601.0, "tokens_per_s": 3.0},
    ]
    # two lines: nothing is drawn between t=2 (the first run's end) and t=600
    assert _segments(rate, [0.0, 600.0]) == [
        ([0.0, 1.0, 2.0], [5.0, 5.0, 7.0]),
        ([600.0, 601.0], [3.0, 3.0]),
    ]


def test_axis_ticks_and_bar_labels_read_whole() -> None:
    from hsx_async.run.report.plot import _human, _label

    assert [_human(v) for v in (0.0, 0.2, 0.4, 1.0, 12.5, 1500.0)] == [
        "0", "0.2", "0.4", "1", "12", "1.5k",
    ]  # fmt: skip
    long = "input_ids contains a token id beyond the model's vocabulary of the server"
    label = _label(long)
    assert label.endswith(" …") and long.startswith(label[:-2]) and len(label) <= 54
    assert long[len(label) - 2] == " ", "cut between two words"
    assert _label("retries exhausted: HTTP 503") == "retries exhausted: HTTP 503"


def test_the_spool_fill_and_each_consumers_lag_come_from_the_ticks(tmp_path: Path) -> None:
    """Issue 29: two runs of an online job (a restart between), a tick without a spool
    (an older hsx's) among them."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    _run_dir(out)
    base = {"shard": "0/1", "quarantined": 0, "retries": {}, "servers": {}, "tokens": 0,
            "bytes": 0, "samples": 0}  # fmt: skip

    def tick(event: str, t: float, held: int, paused: float, lag: dict[str, int]) -> bytes:
        spool = {"held": held, "limit": 1000, "paused_s": paused, "lag": lag}
        return orjson.dumps({"event": event, "time": t, "spool": spool, **base}) + b"\n"

    (out / "events.jsonl").write_bytes(
        tick("start", 100.0, 0, 0.0, {})
        + tick("tick", 101.0, 900, 0.5, {"a": 3, "b": 1})
        + orjson.dumps({"event": "tick", "time": 101.5, **base}) + b"\n"
        + tick("end", 102.0, 400, 2.0, {"a": 1, "b": 2})
        + tick("start", 200.0, 400, 0.0, {"a": 1, "b": 2})
        + tick("tick", 201.0, 100, 1.0, {"a": 0, "b": 0})
    )  # fmt: skip
    spool = build_report(out)["spool"]
    assert spool is not None
    assert (spool["limit"], spool["peak_held"], spool["held"]) == (1000, 900, 100)
    assert spool["paused_s"] == 3.0  # each run's own count, added up
    assert spool["peak_lag"] == {"a": 3, "b": 2} and spool["lag"] == {"a": 0, "b": 0}
    assert [(p["run"], p["t"], p["held"]) for p in spool["series"]] == [
        (0, 0.0, 0), (0, 1.0, 900), (0, 2.0, 400), (1, 100.0, 400), (1, 101.0, 100),
    ]  # fmt: skip
    _, png, _ = write_report(out)
    assert png is not None and png.read_bytes()[:8] == PNG_MAGIC


async def test_an_online_runs_report_has_its_spool(tmp_path: Path, shm_root: Path) -> None:
    samples = write_samples(tmp_path / "in.jsonl", 20, max_len=24)
    async with running_fake_server(FakeOptions(hidden_size=H, aux_layers=AUX,
                                               dump_root=shm_root)) as srv:  # fmt: skip
        output = {"retention": "acked", "consumers": ["trainer"], "spool_limit": "1MiB"}
        config = make_config(tmp_path, samples.path, [srv.url], shm_root, output=output,
                             input={"max_tokens": 64})  # fmt: skip
        await Daemon(config).run()
    spool = build_report(config.output.dir)["spool"]
    assert spool is not None and spool["limit"] == 1 << 20
    assert len(spool["series"]) >= 2  # the start and end lines at least
    assert 0 < spool["peak_held"] <= spool["limit"]
    # Nothing consumed: every sample is still held at the end (a file not yet seen
    # committed counts as the room it took, never less than its file).
    assert spool["held"] >= sum(e.size for e in read_manifest(config.output.dir))
    keep = build_report(_keep_run(tmp_path))
    assert keep["spool"] is None


def _keep_run(tmp_path: Path) -> Path:
    out = tmp_path / "keep"
    _run_dir(out)
    base = {"shard": "0/1", "quarantined": 0, "retries": {}, "servers": {}, "tokens": 0,
            "bytes": 0, "samples": 0}  # fmt: skip
    (out / "events.jsonl").write_bytes(orjson.dumps({"event": "start", "time": 1.0, **base}))
    return out


def test_the_footer_of_servers_out_fits_the_page_and_says_who_came_back(tmp_path: Path) -> None:
    """Issue 39: the "Servers out of rotation" footer was one line cut at the page's edge."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from hsx_async.run.report import plot as report_plot

    reason = "took the request but no meta.json appeared under dump.root " * 3
    spells = [
        {"server": f"http://gpu-node-{i}.cluster.internal:30000", "kind": "dump_missing",
         "reason": f"http://gpu-node-{i}.cluster.internal:30000 {reason}",
         "out": "2026-12-04T19:00:10+00:00", "back": "2026-12-04T19:00:40+00:00" if i else None}
        for i in range(6)
    ]  # fmt: skip
    report = {
        "dataset": "/data/out", "generated": "2026-12-04T20:00:00+00:00",
        "totals": {"samples": 2, "tokens": 5, "bytes": 9, "quarantined": 0, "input_lines": 2},
        "runs": [{"started": "2026-12-04T19:00:00+00:00", "seconds": 100.0, "tokens": 5}],
        "rate": [{"run": 0, "t": 50.0, "tokens_per_s": 0.1}], "quarantine_reasons": {},
        "servers": {}, "retries": {}, "servers_out": spells, "spool": None,
    }  # fmt: skip
    drawn: list[Figure] = []
    real_savefig = Figure.savefig

    def savefig(fig: Figure, *args: object, **kwargs: object) -> None:
        drawn.append(fig)
        real_savefig(fig, *args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", savefig)
        report_plot.render(report, tmp_path / "report.png")
    [fig] = drawn
    [footer] = [t for t in fig.texts if t.get_text().startswith("Servers out of rotation")]
    lines = footer.get_text().splitlines()
    assert lines[0] == "Servers out of rotation (and 2 earlier):"
    assert lines[1].startswith("  http://gpu-node-2.cluster.internal:30000: dump_missing at ")
    assert "back at 19:00:40 (took the request" in lines[1] and len(lines) == 5
    box = footer.get_window_extent(fig.canvas.get_renderer())  # type: ignore[attr-defined]
    page = fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0, (box, page)
    panels = min(ax.get_tightbbox().y0 for ax in fig.axes)  # type: ignore[union-attr]
    assert box.y1 <= panels, "the footer overlaps the panels"


def test_the_time_axis_leaves_out_the_idle_time_between_runs() -> None:
    """Issue 39: the rate panel's axis ran from the first start to the last end, so the
    14 minutes between a run and its resume were drawn as part of the job (the axis said
    17 min, the header 3m10s). The axis now shows the time runs ran."""
    pytest.importorskip("matplotlib")
    from hsx_async.run.report.plot import idle_gaps, squeeze

    def run(started: str, seconds: float) -> dict[str, object]:
        return {"started": started, "seconds": seconds}

    report = {"runs": [run("2026-12-04T10:00:00+00:00", 160.0),
                       run("2026-12-04T10:16:40+00:00", 30.0)]}  # fmt: skip
    gaps = idle_gaps(report)
    assert gaps == [(160.0, 840.0)]
    assert squeeze(100.0, gaps) == 100.0  # within the first run
    assert squeeze(1000.0, gaps) == 160.0  # the resume starts where the first run ended
    assert squeeze(1030.0, gaps) == 190.0  # the header's 160 + 30 s
    # Shards that run side by side leave no gap between them.
    side = {"runs": [run("2026-12-04T10:00:00+00:00", 100.0),
                     run("2026-12-04T10:00:30+00:00", 100.0)]}  # fmt: skip
    assert idle_gaps(side) == []


async def test_the_report_times_a_run_as_the_terminal_does(tmp_path: Path, shm_root: Path) -> None:
    """Issue 39: the terminal said 745 tokens/s, the report 1.3k: the report's run began at
    its start line, after the start-up checks and the resume's reading that the terminal
    counted. The start line now carries the run's own start."""
    samples = write_samples(tmp_path / "in.jsonl", 12, max_len=24)
    async with running_fake_server(FakeOptions(hidden_size=H, aux_layers=AUX,
                                               dump_root=shm_root)) as srv:  # fmt: skip
        config = make_config(tmp_path, samples.path, [srv.url], shm_root)
        daemon = Daemon(config)
        slow_check = preflight_delay(0.5)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("hsx_async.run.daemon.daemon.operator_problem", slow_check)
            summary = await daemon.run()
    [run] = build_report(config.output.dir)["runs"]
    assert run["tokens"] == summary.tokens
    assert run["seconds"] >= 0.5  # the start-up is in it, as in the terminal's
    assert abs(run["seconds"] - summary.seconds) < 0.05, (run["seconds"], summary.seconds)


def preflight_delay(seconds: float) -> Any:
    """hsx run's operator checks, taking ``seconds`` longer (a slow disk's probe write)."""
    import time

    from hsx_async.run.check.preflight import operator_problem

    def slow(config: Any) -> str:
        time.sleep(seconds)  # the start-up being timed, not a synchronisation
        return operator_problem(config)

    return slow


def test_a_consumed_and_deleted_sample_counts_as_written(tmp_path: Path) -> None:
    """Issue 37 (8): a finished online job of 60 acknowledged samples was reported as "0
    samples written of 60 total, 0 tokens, 0 B on disk"."""
    write_dataset(tmp_path, num_samples=4)
    entries = read_manifest(tmp_path)
    ids = [str(e.id) for e in entries]
    record_registry(tmp_path, Registry(ACKED, ("train",), 0), retired=0)
    hold = OwnerHold(tmp_path / "consumers" / "train", "ab" * 8)
    log = ConsumerLog(tmp_path, "train")
    log.lease(owner="ab" * 8, rank=0, epoch=0, order=ids, present=set(ids), count=3)
    log.ack(owner="ab" * 8, epoch=0, ids=ids[:3])
    hold.close()
    assert len(Retirer(tmp_path).retire(entries)) == 3
    totals = build_report(tmp_path)["totals"]
    assert totals["samples"] == 4 and totals["retired"] == 3
    assert totals["tokens"] == sum(e.num_tokens for e in entries)
    assert totals["bytes"] == entries[3].size  # on disk now
