"""Draw ``report.png`` from :func:`hsx_async.run.report.numbers.build_report`'s numbers.

Imported only when the report is written, so matplotlib stays an optional extra; it is
driven through its object API with the Agg canvas (no display, no global pyplot state).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hsx_async.dataset.durable import write_durably
from hsx_async.units import human_bytes

_INK = "#1f2430"
_MUTED = "#7a8194"
_ACCENT = "#2a6fdb"
_WARN = "#d9822b"
_BAD = "#c23b3b"
_GRID = "#e6e8ee"


def _human(n: float) -> str:
    for suffix in ("", "k", "M", "G"):
        if abs(n) < 1000:
            if suffix:
                return f"{n:.1f}{suffix}"
            # Ticks below 10 keep a decimal: 0.2, 0.4, … not "0 0 0 0".
            return f"{n:.0f}" if n == int(n) or abs(n) >= 10 else f"{n:.1f}"
        n /= 1000
    return f"{n:.1f}T"


def _duration(seconds: float) -> str:
    s = int(seconds)
    h, rem = divmod(s, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def _style(ax: Axes, title: str) -> None:
    ax.set_title(title, loc="left", fontsize=11, color=_INK, fontweight="bold", pad=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_color(_MUTED)
    ax.tick_params(colors=_MUTED, labelsize=8)
    ax.grid(True, color=_GRID, linewidth=0.8)
    ax.set_axisbelow(True)


def _empty(ax: Axes, title: str, text: str) -> None:
    _style(ax, title)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.text(0.5, 0.5, text, ha="center", va="center", color=_MUTED, fontsize=11,
            transform=ax.transAxes)  # fmt: skip


def _rate_panel(ax: Axes, report: dict[str, Any]) -> None:
    rate = report["rate"]
    if not rate:
        _empty(ax, "Rate over time", "no run events yet (written by hsx run)")
        return
    _style(ax, "Rate over time (tokens/s)")
    gaps = idle_gaps(report)
    span = squeeze(max(p["t"] for p in rate), gaps)
    scale, unit = _time_unit(span)
    starts = _run_starts(report)
    for seconds, y in _segments(rate, starts):
        t = [squeeze(x, gaps) / scale for x in seconds]
        ax.fill_between(t, y, step="pre", color=_ACCENT, alpha=0.18, linewidth=0)
        ax.step(t, y, where="pre", color=_ACCENT, linewidth=1.6)
    ax.set_xlabel(_AXIS_LABEL.format(unit=unit), color=_MUTED, fontsize=8)
    ax.set_xlim(left=0)
    # An all-zero run still gets a readable axis (not 0 to 0).
    top = max(p["tokens_per_s"] for p in rate)
    ax.set_ylim(0, top * 1.08 if top > 0 else 1.0)
    ax.yaxis.set_major_formatter(lambda v, _: _human(v))
    for start in starts[1:]:
        at = squeeze(start, gaps) / scale
        idle = sum(length for begin, length in gaps if begin + length == start)
        note = f" resumed after {_duration(idle)} idle" if idle else " resumed"
        ax.axvline(at, color=_MUTED, linestyle="--", linewidth=0.8)
        ax.text(at, ax.get_ylim()[1] * 0.97, note, color=_MUTED, fontsize=7, va="top")


# The time axes show the time runs ran: the idle time between runs is cut out, so the
# axis ends where the header's duration says (issue 39: hours between a kill and its
# resume were drawn as part of the job).
_AXIS_LABEL = "time running, idle time between runs left out ({unit})"


def _time_unit(span: float) -> tuple[float, str]:
    return (1.0, "s") if span < 120 else (60.0, "min") if span < 3 * 3600 else (3600.0, "h")


def idle_gaps(report: dict[str, Any]) -> list[tuple[float, float]]:
    """(start, length) of each stretch no run covered, in seconds since the first start
    (runs of shards that overlap in time leave no gap between them)."""
    t0 = _first_start(report)
    spans = sorted((_epoch(r["started"]) - t0, float(r["seconds"])) for r in report["runs"])
    gaps: list[tuple[float, float]] = []
    covered: float | None = None  # the end of the runs so far
    for start, seconds in spans:
        if covered is not None and start > covered:
            gaps.append((covered, start - covered))
        covered = start + seconds if covered is None else max(covered, start + seconds)
    return gaps


def squeeze(t: float, gaps: list[tuple[float, float]]) -> float:
    """``t`` (seconds since the first start) on the axis without the idle gaps."""
    return t - sum(min(length, max(0.0, t - begin)) for begin, length in gaps)


def _spool_panel(ax: Axes, spool: dict[str, Any], report: dict[str, Any]) -> None:
    """The spool's fill (bytes, with its limit) and each consumer's lag (samples, right)."""
    limit = spool["limit"]
    _style(
        ax, "Spool on disk and consumer lag" + (f" (limit {human_bytes(limit)})" if limit else "")
    )
    series = spool["series"]
    gaps = idle_gaps(report)
    scale, unit = _time_unit(squeeze(max(p["t"] for p in series), gaps))
    t = [squeeze(p["t"], gaps) / scale for p in series]
    ax.step(t, [p["held"] for p in series], where="post", color=_ACCENT, linewidth=1.6,
            label="spool held")  # fmt: skip
    if limit:
        ax.axhline(limit, color=_BAD, linestyle="--", linewidth=0.9, label="spool_limit")
    ax.set_xlim(left=0)
    ax.set_ylim(0, max(limit, spool["peak_held"], 1) * 1.1)
    ax.yaxis.set_major_formatter(lambda v, _: human_bytes(v))
    ax.set_xlabel(_AXIS_LABEL.format(unit=unit), color=_MUTED, fontsize=8)
    lag_ax = ax.twinx()
    for name in spool["peak_lag"]:
        lag_ax.step(t, [p["lag"].get(name, 0) for p in series], where="post", color=_WARN,
                    linewidth=1.0, label=f"{name} lag (samples)")  # fmt: skip
    lag_ax.set_ylim(0, max([*spool["peak_lag"].values(), 1]) * 1.1)
    lag_ax.tick_params(colors=_WARN, labelsize=8)
    for side in ("top", "left"):
        lag_ax.spines[side].set_visible(False)
    handles = ax.get_legend_handles_labels()
    more = lag_ax.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=7, loc="upper left",
              frameon=False)  # fmt: skip


def _run_starts(report: dict[str, Any]) -> list[float]:
    """Each run's start in seconds since the first one's (``report["runs"]`` order)."""
    t0 = _first_start(report)
    return [_epoch(run["started"]) - t0 for run in report["runs"]]


def _segments(
    rate: list[dict[str, Any]], starts: list[float]
) -> list[tuple[list[float], list[float]]]:
    """One line per run, from its start to its last point: the time between two runs is
    a gap, not a plateau of the last rate (a point's ``run`` indexes ``report["runs"]``)."""
    by_run: dict[int, list[dict[str, Any]]] = {}
    for p in rate:
        by_run.setdefault(int(p.get("run", 0)), []).append(p)
    lines = []
    for index, points in sorted(by_run.items()):
        points.sort(key=lambda p: p["t"])
        start = starts[index] if index < len(starts) else points[0]["t"]
        # step(where="pre"): y[i] is drawn over (t[i-1], t[i]]; the first pair only anchors.
        lines.append(
            (
                [start, *(p["t"] for p in points)],
                [points[0]["tokens_per_s"], *(p["tokens_per_s"] for p in points)],
            )
        )
    return lines


def _epoch(iso: str) -> float:
    return dt.datetime.fromisoformat(iso).timestamp()


def _first_start(report: dict[str, Any]) -> float:
    runs = report["runs"]
    return _epoch(runs[0]["started"]) if runs else 0.0


def _bars(ax: Axes, title: str, counts: dict[str, int], color: str, empty: str,
          *, share: bool = False) -> None:  # fmt: skip
    """Horizontal bars, largest on top, each named above its bar (long names fit)."""
    counts = {name: n for name, n in counts.items() if n > 0}  # a server asked nothing: no bar
    if not counts:
        _empty(ax, title, empty)
        return
    _style(ax, title)
    items = list(counts.items())[:6][::-1]
    rest = sum(counts.values()) - sum(v for _, v in items)
    if rest:
        items.insert(0, (f"{len(counts) - len(items)} other kinds", rest))
    values = [v for _, v in items]
    total = sum(counts.values())
    base = max(len(items), 4) - len(items)  # a lone bar keeps the width of one of four
    ax.barh([base + i for i in range(len(items))], values, color=color, height=0.42)
    ax.set_yticks([])
    ax.grid(True, axis="x", color=_GRID)
    ax.grid(False, axis="y")
    ax.spines["left"].set_visible(False)
    ax.set_xlim(0, max(values) * 1.25)
    ax.set_ylim(-0.5, base + len(items) - 0.2)
    ax.xaxis.set_major_formatter(lambda v, _: _human(v))
    for i, (name, v) in enumerate(items):
        label = _label(name)
        ax.text(0, base + i + 0.26, label, va="bottom", fontsize=8, color=_INK)
        text = f" {v:,}" + (f" ({100 * v / total:.0f}%)" if share else "")
        ax.text(v, base + i, text, va="center", fontsize=8, color=_INK, fontweight="bold")


_LABEL_CHARS = 52  # what fits above a bar of a third of the page at 8 pt


def _label(name: str) -> str:
    """``name``, or as many of its words as fit, then "…" (never cut inside a word)."""
    if len(name) <= _LABEL_CHARS:
        return name
    cut = name[: _LABEL_CHARS - 1].rsplit(" ", 1)[0]
    return cut.rstrip(" :;,") + " …"


def _header(fig: Figure, report: dict[str, Any]) -> None:
    totals = report["totals"]
    runs = report["runs"]
    seconds = sum(r["seconds"] for r in runs)
    tokens_s = sum(r["tokens"] for r in runs) / seconds if seconds else 0.0
    fig.text(0.04, 0.955, "hsx job report", fontsize=17, fontweight="bold", color=_INK)
    fig.text(0.04, 0.925, f"{report['dataset']}  ·  {report['generated']}", fontsize=9,
             color=_MUTED)  # fmt: skip
    lines = totals.get("input_lines")
    of = f" of {lines:,} total" if isinstance(lines, int) and lines else ""
    cards = [
        (f"{totals['samples']:,}", f"samples written{of}"),
        (_human(totals["tokens"]), "tokens"),
        (human_bytes(totals["bytes"]), _on_disk(totals)),
        (f"{totals['quarantined']:,}", f"quarantined{of}"),
        (_duration(seconds), f"in {len(runs)} run{'s' if len(runs) != 1 else ''}"),
        (_human(tokens_s), "tokens/s (mean)"),
    ]
    for i, (value, label) in enumerate(cards):
        x = 0.04 + i * 0.158
        bad = label.startswith("quarantined") and totals["quarantined"] > 0
        fig.text(x, 0.865, value, fontsize=16, fontweight="bold", color=_BAD if bad else _ACCENT)
        fig.text(x, 0.845, label, fontsize=8, color=_MUTED)


_FOOTER_SPELLS = 4  # the latest spells the footer lists, one line each
_FOOTER_CHARS = 190  # what fits across the page at 7 pt
_FOOTER_LINE = 0.018  # one footer line, in figure heights


def _footer_lines(spells: list[dict[str, Any]]) -> list[str]:
    """The footer: a title, then each of the latest spells on its own line (cut at a word,
    never at the page's edge), and whether the server came back."""
    if not spells:
        return []
    more = len(spells) - _FOOTER_SPELLS
    title = "Servers out of rotation" + (f" (and {more} earlier)" if more > 0 else "") + ":"
    lines = [
        f"  {s['server']}: {s['kind']} at {s['out'][11:19]}, "
        + (f"back at {s['back'][11:19]}" if s["back"] else "not back")
        + (f" ({_why(s)})" if s.get("reason") else "")
        for s in spells[-_FOOTER_SPELLS:]
    ]
    return [title, *(_cut(line, _FOOTER_CHARS) for line in lines)]


def _why(spell: dict[str, Any]) -> str:
    """The spell's reason without the server's URL it usually starts with (said already)."""
    reason, server = str(spell["reason"]), str(spell["server"])
    return reason.removeprefix(server).lstrip(": ") or reason


def _cut(text: str, chars: int) -> str:
    if len(text) <= chars:
        return text
    return text[: chars - 1].rsplit(" ", 1)[0].rstrip(" :;,(") + " …"


def _servers_out(fig: Figure, lines: list[str]) -> None:
    """The footer under the panels (the page's bottom margin is made for its lines)."""
    if lines:
        fig.text(0.04, 0.008, "\n".join(lines), fontsize=7, color=_WARN, va="bottom",
                 linespacing=1.3)  # fmt: skip


def render(report: dict[str, Any], path: Path) -> None:
    """One A4-landscape-ish page: headline numbers, rate, and three breakdowns."""
    fig = Figure(figsize=(12, 8), dpi=110, facecolor="white")
    FigureCanvasAgg(fig)
    _header(fig, report)
    spool = report.get("spool")
    ratios = [1.15, 0.9, 1] if spool else [1.15, 1]
    footer = _footer_lines(report.get("servers_out", []))
    grid = fig.add_gridspec(len(ratios), 3, left=0.06, right=0.94 if spool else 0.97,
                            top=0.79, bottom=0.07 + _FOOTER_LINE * len(footer),
                            hspace=0.5, wspace=0.55, height_ratios=ratios)  # fmt: skip
    _rate_panel(fig.add_subplot(grid[0, :]), report)
    if spool:
        _spool_panel(fig.add_subplot(grid[1, :]), spool, report)
    row = len(ratios) - 1
    _bars(fig.add_subplot(grid[row, 0]), "Quarantine reasons", report["quarantine_reasons"], _BAD,
          "nothing quarantined")  # fmt: skip
    _bars(fig.add_subplot(grid[row, 1]), "Requests per server", report["servers"], _ACCENT,
          "no requests recorded", share=True)  # fmt: skip
    _bars(fig.add_subplot(grid[row, 2]), "Failed attempts (retried)", report["retries"], _WARN,
          "no failed attempts")  # fmt: skip
    _servers_out(fig, footer)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_durably(path, lambda tmp: fig.savefig(tmp, format="png"))


def _on_disk(totals: dict[str, Any]) -> str:
    retired = totals.get("retired", 0)
    return f"on disk ({retired:,} consumed and deleted)" if retired else "on disk"
