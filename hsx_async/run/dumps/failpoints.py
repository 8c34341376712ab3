"""Crash points for the crash-consistency suite (issue 7), off unless asked for.

``HSX_FAILPOINT=<name>:<n>`` makes the process SIGKILL itself the ``n``-th time it passes
``failpoint(<name>)`` (1-based), like a power cut at that exact step. Unset, a call costs
one dict lookup. Names are listed in :data:`POINTS`; an unknown name is an error, so a
typo cannot make a crash test pass vacuously.
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = (
    "writer.after_temp_write",  # data written to the temp file, not yet fsynced
    "writer.after_fsync",  # temp file durable, not yet renamed
    "writer.after_rename",  # final name visible, manifest line not yet written
    "commit.before_append",  # manifest line about to be written
    "commit.after_append",  # manifest line durable, dump not yet deleted
    "dump.during_delete",  # dump deletion under way
)
# ``hsx regenerate``'s points, apart: the daemon's crash suite runs every one of POINTS.
REGENERATE_POINTS = (
    "regenerate.before_append",  # a conversation regenerated, its line not yet written
    "regenerate.after_append",  # its line durable
)

_lock = threading.Lock()
_target: tuple[str, int] | None = None
_seen = 0


def _parse(spec: str) -> tuple[str, int]:
    name, _, count = spec.partition(":")
    known = POINTS + REGENERATE_POINTS
    if name not in known:
        raise ValueError(f"HSX_FAILPOINT names unknown point {name!r}; known: {', '.join(known)}")
    return name, int(count or "1")


def configure(spec: str | None) -> None:
    global _target, _seen  # noqa: PLW0603 - process-wide switch, set once at start
    _target = _parse(spec) if spec else None
    _seen = 0


def failpoint(name: str) -> None:
    global _seen  # noqa: PLW0603
    if _target is None or _target[0] != name:
        return
    with _lock:
        _seen += 1
        if _seen == _target[1]:
            os.kill(os.getpid(), signal.SIGKILL)


configure(os.environ.get("HSX_FAILPOINT"))
