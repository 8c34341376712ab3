"""Summarise a py-spy profile written by a bench script's ``--profile-dir`` (raw format:
one collapsed stack and its sample count per line).

    python bench/profile_summary.py bench/results/profiles/hsx-c64.txt
    python bench/profile_summary.py --top 40 --thread MainThread PROFILE.txt

Prints each thread's share of the samples, then the functions with the largest inclusive
share (a function counted once per stack, however deep it recurs) and the largest self
share. Start-up (imports, argument parsing) is left out so the figures describe the run.
With ``--profile-gil`` the samples are those of the thread holding the GIL, so a thread's
share is its part of the client's serial Python time.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_THREAD = re.compile(r"^thread \(\d+\)(?::\s*)?")
_LINE_NO = re.compile(r":\d+\)$")
# Frames that only exist while the client starts: imports and building the CLI parser.
_START_UP = ("build_parser (hsx_async/cli/__init__.py", "<frozen importlib._bootstrap>")


@dataclass
class Summary:
    total: int = 0
    threads: Counter[str] = field(default_factory=Counter)
    inclusive: Counter[str] = field(default_factory=Counter)
    self_time: Counter[str] = field(default_factory=Counter)


def summarise(lines: Iterable[str], thread: str | None = None) -> Summary:
    out = Summary()
    for line in lines:
        if not line.strip():
            continue
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        name = _THREAD.sub("", frames[0]).strip() or "(unnamed)"
        if any(marker in stack for marker in _START_UP):
            continue
        if thread is not None and name != thread:
            continue
        n = int(count)
        out.total += n
        out.threads[name] += n
        functions = [_LINE_NO.sub(")", f) for f in frames[1:]]
        for function in dict.fromkeys(functions):
            out.inclusive[function] += n
        if functions:
            out.self_time[functions[-1]] += n
    return out


def render(summary: Summary, top: int) -> str:
    if summary.total == 0:
        return "no samples\n"

    def pct(n: int) -> str:
        return f"{100 * n / summary.total:5.1f}%"

    lines = [f"{summary.total} samples"]
    lines += ["", "by thread:"] + [f"  {pct(n)}  {t}" for t, n in summary.threads.most_common()]
    lines += ["", f"top {top}, inclusive:"]
    lines += [f"  {pct(n)}  {f}" for f, n in summary.inclusive.most_common(top)]
    lines += ["", f"top {top}, self:"]
    lines += [f"  {pct(n)}  {f}" for f, n in summary.self_time.most_common(top)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("profile", type=Path, help="a raw py-spy profile (one stack per line)")
    p.add_argument("--top", type=int, default=30, help="functions to list (default 30)")
    p.add_argument("--thread", help="only this thread (e.g. MainThread, hsx-copy_0)")
    args = p.parse_args(argv)
    with args.profile.open() as f:
        sys.stdout.write(render(summarise(f, args.thread), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
