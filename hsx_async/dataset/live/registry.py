"""Who must have a sample before the spool may delete it (PROTOCOL §6.1): the registry,
``consumers.json``, and the dataset's identity.

The registry is *versioned*: every change ``hsx run`` records raises ``version`` by one,
and it is written under the retirement lock (:data:`RETIRE_LOCK`), the lock under which
every retirement decides. So a sample is deleted only under the list in force at that
instant, never under a list a reader loaded earlier (issue 37: a reader that kept
``["drafter"]`` deleted what a newly added ``"eval"`` still needed). Nobody caches it:
:func:`read_registry` is a stat and, when the file changed, one small read.

The identity (``consumers/identity``, 32 hex digits) names one dataset: a trainer's
``state_dict`` carries it, and ``load_state_dict`` refuses another dataset's. Whoever
needs it first makes it (link, so two makers agree on one).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, Literal

import orjson

from hsx_async.dataset.durable import exclusive_lock, fsync_dir, fsync_file, write_atomic
from hsx_async.errors import DatasetError
from hsx_async.protocol import NS_PATTERN, valid_ns

REGISTRY = "consumers.json"
CONSUMERS_DIR = "consumers"
RETIRE_LOCK = ".retire.lock"
IDENTITY = "identity"
KEEP: Final = "keep"
ACKED: Final = "acked"
Retention = Literal["keep", "acked"]
RETENTIONS: tuple[str, ...] = (KEEP, ACKED)
RETIRE_LOCK_WAIT_S = 60.0


def check_name(name: object) -> str:
    """A consumer name becomes a directory name: the rule of a dump namespace (PROTOCOL §2:
    letters, digits and ``._-``, 1–64 characters), the same function."""
    if not valid_ns(name):
        raise DatasetError(
            f"consumer name {name!r} must match {NS_PATTERN} (letters, digits, '._-', ≤ 64)"
        )
    assert isinstance(name, str)
    return name


@dataclass(frozen=True, slots=True)
class Registry:
    retention: Retention
    consumers: tuple[str, ...]
    spool_limit: int  # bytes of sample files a run may hold at once; 0: no limit
    version: int = 0  # raised by one at every recorded change; 0: not recorded yet

    def to_json(self) -> bytes:
        record = {
            "version": self.version,
            "retention": self.retention,
            "consumers": list(self.consumers),
            "spool_limit": self.spool_limit,
        }
        return orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n"

    def same_rules(self, other: Registry | None) -> bool:
        return other is not None and replace(other, version=self.version) == self

    @property
    def deletes(self) -> bool:
        """Whether acknowledgements delete samples under this registry."""
        return self.retention == ACKED and bool(self.consumers)

    def must_ack(self, name: str) -> bool:
        """Whether ``name``'s acknowledgements decide when a sample is deleted."""
        return self.retention == ACKED and name in self.consumers


def read_registry(out_dir: Path) -> Registry | None:
    path = out_dir / REGISTRY
    try:
        raw = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError:
        raise DatasetError(f"{path} is not valid JSON; hsx did not write it") from None
    try:
        retention = raw["retention"]
        names = tuple(check_name(n) for n in raw["consumers"])
        limit = raw["spool_limit"]
        version = raw.get("version", 1)  # a version-5 registry: its first version
    except (KeyError, TypeError, AttributeError) as exc:
        raise DatasetError(f"{path}: missing or mistyped {exc}; hsx did not write it") from None
    bad_version = type(version) is not int or version < 1
    if retention not in RETENTIONS or type(limit) is not int or limit < 0 or bad_version:
        raise DatasetError(
            f"{path}: retention {retention!r} / spool_limit {limit!r} / version {version!r} "
            "invalid; hsx did not write it"
        )
    return Registry(retention, names, limit, version)


@contextlib.contextmanager
def retirement_lock(out_dir: Path) -> Iterator[None]:
    """The lock every retirement and every change of the registry holds."""
    lock = out_dir / CONSUMERS_DIR / RETIRE_LOCK
    lock.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(
        lock, f"{lock}: held for {RETIRE_LOCK_WAIT_S:.0f} s; is a process stuck?",
        wait=RETIRE_LOCK_WAIT_S,
    ):  # fmt: skip
        yield


def record_registry(out_dir: Path, registry: Registry, *, retired: int) -> Registry:
    """Record the registry for a run (blocking; under the directory lock); the one in
    force. Unchanged rules keep their version; a change raises it by one. A consumer added
    after samples were deleted could never receive those: refused."""
    with retirement_lock(out_dir):
        old = read_registry(out_dir)
        if registry.same_rules(old):
            assert old is not None
            return old
        if old is not None and retired and registry.retention == ACKED:
            added = sorted(set(registry.consumers) - set(old.consumers))
            if added:
                raise DatasetError(
                    f"[output].consumers adds {', '.join(added)}, but the spool has already "
                    f"deleted {retired:,} samples the registered consumers "
                    f"({', '.join(old.consumers) or 'none'}) acknowledged: the new ones could "
                    "never receive them. Remove them from [output].consumers, or extract into "
                    "a new [output].dir"
                )
        recorded = replace(registry, version=(old.version if old else 0) + 1)
        write_atomic(out_dir / REGISTRY, recorded.to_json())
        return recorded


def dataset_identity(out_dir: Path) -> str:
    """This dataset's identity (made on first use: a temp file linked into place, so
    concurrent makers agree on the first one)."""
    path = out_dir / CONSUMERS_DIR / IDENTITY
    with contextlib.suppress(FileNotFoundError):
        return _read_identity(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{IDENTITY}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    tmp.write_text(secrets.token_hex(16) + "\n")
    try:
        fsync_file(tmp)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
            fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return _read_identity(path)


def _read_identity(path: Path) -> str:
    text = path.read_text().strip()
    if len(text) != 32 or any(c not in "0123456789abcdef" for c in text):
        raise DatasetError(
            f"{path} holds {text[:40]!r}, not a dataset identity; hsx did not write it"
        )
    return text
