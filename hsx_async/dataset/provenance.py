"""What a dataset was made from, and the lock that keeps two runs off one shard.

``provenance.json`` in the output directory records the input fingerprint, the model shape
and (once a server answered) the model and server version, plus the config. A resume
against another input or shape is refused — mixing them would make a dataset whose rows
mean two different things — unless the operator passes ``--allow-provenance-change``.

It also records which final hidden state the dataset holds (``final_state``, PROTOCOL §4:
one kind per dataset, learnt from the first dump and enforced on every later one by
:class:`FinalStateGuard`) and, when the server reports it, the model's final norm
(``final_norm``: ``{"kind": "rms" | "rms_one_plus", "eps": ...}``), which turns one kind
into the other.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from hsx_async import __version__
from hsx_async.dataset.durable import exclusive_lock, write_atomic
from hsx_async.dataset.manifest import (
    MANIFEST,
    QUARANTINE,
    Readable,
    hash_stream,
    log_files,
    shard_count_of,
)
from hsx_async.errors import DatasetError, DumpError, IdentityError
from hsx_async.protocol import (
    BF16_STORAGE,
    NORM_KINDS,
    POST_NORM,
    PROTOCOL_VERSION,
    Storage,
    parse_final_state,
    parse_storage,
)

PROVENANCE = "provenance.json"
# Keys a later rewrite of provenance.json keeps (learnt during a run, not from the config).
_LEARNT_KEYS = ("final_state", "final_norm", "input_samples", "identity", "servers")


def fingerprint(fh: Readable, path: Path, *, prefix: int | None = None) -> dict[str, Any]:
    """Size and XXH3-64 of the whole input file, read from ``fh`` (blocking; ~0.1 s/GB
    from page cache). With ``prefix`` (the size a dataset recorded), also the XXH3-64 of
    the first ``prefix`` bytes, as ``extends``: an input that only grew since (lines
    appended, as while a run reads it) is the same input, extended."""
    size, whole, head = hash_stream(fh, prefix=prefix)
    found: dict[str, Any] = {"path": str(path), "bytes": size, "xxh3_64": whole}
    if head is not None and prefix != size:
        found["extends"] = {"bytes": prefix, "xxh3_64": head}
    return found


def _json_safe(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_json_safe(v) for v in value]
    return value


@dataclass(frozen=True)
class Provenance:
    input: dict[str, Any]
    hidden_size: int
    aux_layers: list[int]
    config: Mapping[str, Any]  # the job's settings, flattened (dotted keys)
    model: str = ""
    server: str = ""
    final_norm: dict[str, Any] | None = None
    storage: Storage = BF16_STORAGE

    def to_dict(self) -> dict[str, Any]:
        raw: dict[str, Any] = {
            "protocol": PROTOCOL_VERSION,
            "hsx": __version__,
            "input": self.input,
            "hidden_size": self.hidden_size,
            "aux_layers": self.aux_layers,
            "dtype": self.storage.dtype,
            "quantized": list(self.storage.quantized),
            "model": self.model,
            "server": self.server,
            "config": {k: _json_safe(v) for k, v in self.config.items()},
        }
        if self.storage.is_fp8:
            raw["scales"] = self.storage.scales  # the FP8 layout (PROTOCOL §3)
        if self.final_norm is not None:
            raw["final_norm"] = self.final_norm
        return raw

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2)


def dataset_storage(prov: Mapping[str, Any] | None) -> Storage:
    """How a dataset stores hidden states, from its provenance (none recorded, as in
    every version before 3: bfloat16)."""
    if prov is None:
        return BF16_STORAGE
    try:
        return parse_storage(
            prov.get("dtype"), prov.get("quantized"), PROVENANCE, prov.get("scales")
        )
    except DumpError as exc:
        raise DatasetError(str(exc)) from None


def parse_final_norm(raw: object) -> dict[str, Any] | None:
    """``{"kind": "rms" | "rms_one_plus", "eps": float}`` as a server or provenance gives
    it; None for anything else (unknown stays unknown rather than guessed)."""
    if not isinstance(raw, Mapping):
        return None
    kind, eps = raw.get("kind"), raw.get("eps")
    if kind not in NORM_KINDS or isinstance(eps, bool) or not isinstance(eps, int | float):
        return None
    return {"kind": kind, "eps": float(eps)}


def dataset_final_state(prov: Mapping[str, Any] | None) -> str | None:
    """The final-state kind a dataset holds, from its provenance: the recorded kind; a
    version-1 dataset's is post-norm; None while a new dataset has not seen a dump."""
    if prov is None:
        return None
    if "final_state" in prov:
        try:
            return parse_final_state(prov["final_state"], f"{PROVENANCE} final_state")
        except DumpError as exc:
            raise DatasetError(str(exc)) from None
    if prov.get("protocol") == 1:
        return POST_NORM
    return None


def read_provenance(out_dir: Path) -> dict[str, Any] | None:
    try:
        data = (out_dir / PROVENANCE).read_bytes()
    except FileNotFoundError:
        return None
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise DatasetError(
            f"{out_dir / PROVENANCE} is not valid JSON; restore or remove it"
        ) from None
    if not isinstance(raw, dict):
        raise DatasetError(f"{out_dir / PROVENANCE} is not a JSON object")
    return raw


def mismatches(old: dict[str, Any], new: Provenance) -> list[str]:
    """Why ``new`` may not extend the dataset recorded in ``old`` (empty: it may)."""
    found = []
    old_in = old.get("input", {})
    if not _same_input(old_in, new.input):
        found.append(
            f"input differs: the dataset was made from {old_in.get('path')} "
            f"({old_in.get('bytes')} bytes, xxh3 {old_in.get('xxh3_64')}), this run reads "
            f"{new.input['path']} ({new.input['bytes']} bytes, xxh3 {new.input['xxh3_64']})"
        )
    if old.get("hidden_size") != new.hidden_size or old.get("aux_layers") != new.aux_layers:
        found.append(
            f"model shape differs: dataset has hidden_size {old.get('hidden_size')}, aux_layers "
            f"{old.get('aux_layers')}; config has {new.hidden_size}, {new.aux_layers}"
        )
    if new.model and old.get("model") and old.get("model") != new.model:
        found.append(
            f"model differs: dataset made with {old.get('model')!r}, server now serves "
            f"{new.model!r}"
        )
    return found


def _same_input(old: Any, new: dict[str, Any]) -> bool:
    """The same input, or the same one with lines appended (its first ``old["bytes"]``
    bytes hash as recorded: :func:`fingerprint` with ``prefix``)."""
    if not isinstance(old, dict):
        return False
    if (old.get("bytes"), old.get("xxh3_64")) == (new["bytes"], new["xxh3_64"]):
        return True
    return new.get("extends") == {"bytes": old.get("bytes"), "xxh3_64": old.get("xxh3_64")}


def write_provenance(out_dir: Path, data: bytes) -> None:
    write_atomic(out_dir / PROVENANCE, data)


def check_and_record(
    out_dir: Path,
    record: Provenance,
    *,
    allow_change: bool,
    samples: bool = True,
    lines: bool = True,
) -> None:
    """Refuse a record that may not extend the dataset's, else write it. ``samples``:
    the dataset holds samples (made under the old record's shape, model and storage);
    ``lines``: it holds manifest or quarantine lines (numbered in the old input). What no
    sample or line was made under binds nothing: a corrected rerun of a run that stopped
    before its first sample (a wrong aux_layers, say) replaces the record."""
    old = read_provenance(out_dir)
    if old is not None and not lines:
        old = None  # nothing was made under it
    if old is not None:
        if samples:
            _check_storage(out_dir, old, record)
        problems = mismatches(old, record) if samples else _input_mismatch(old, record)
        if problems and not allow_change:
            raise DatasetError(
                f"{out_dir} belongs to another run: " + "; ".join(problems) + ". Use a new "
                "output.dir, or pass --allow-provenance-change if this is intended"
            )
        if samples and not problems and _only_grown(out_dir, old, record):
            return
    new = record.to_dict()
    if old is not None and samples:
        for key in _LEARNT_KEYS:
            if key in old and key not in new:
                new[key] = old[key]
    elif old is not None and "input_samples" in old:
        new["input_samples"] = old["input_samples"]
    write_provenance(out_dir, orjson.dumps(new, option=orjson.OPT_INDENT_2))


def _check_storage(out_dir: Path, old: dict[str, Any], record: Provenance) -> None:
    have = dataset_storage(old)
    if have != record.storage:
        # Not overridable: one dataset holds one storage (its readers, exports and
        # verify take it from provenance.json), as it holds one final-state kind.
        raise DatasetError(
            f"{out_dir} stores hidden states as {have.describe()} (provenance.json); "
            f"this config asks for {record.storage.describe()}. Set [output].dtype, "
            "[output].quantize and [output].scales as the dataset was made, or use a new "
            "output.dir"
        )


def _input_mismatch(old: dict[str, Any], record: Provenance) -> list[str]:
    return [p for p in mismatches(old, record) if p.startswith("input differs")]


def _only_grown(out_dir: Path, old: dict[str, Any], record: Provenance) -> bool:
    """Nothing new to record but, perhaps, lines appended to the input (recorded here);
    False: the record has news (a model, a final norm) to write."""
    old_in = old.get("input") or {}
    grown = (old_in.get("bytes"), old_in.get("xxh3_64")) != (
        record.input["bytes"],
        record.input["xxh3_64"],
    )
    if grown:
        # The same input with lines appended: from now on the whole of it is the input.
        old["input"] = record.input
        write_provenance(out_dir, orjson.dumps(old, option=orjson.OPT_INDENT_2))
    news_norm = record.final_norm is not None and old.get("final_norm") != record.final_norm
    return bool(old.get("model") or not record.model) and not news_norm


class FinalStateGuard:
    """One final-state kind per dataset (PROTOCOL §4). The first dump of a new dataset
    sets it, recorded in ``provenance.json`` before that sample can be written; a dump of
    another kind fails its attempt. Thread-safe: dumps are validated in several threads."""

    def __init__(self, out_dir: Path) -> None:
        self._out_dir = out_dir
        self._kind = dataset_final_state(read_provenance(out_dir))
        self._lock = threading.Lock()

    @property
    def kind(self) -> str | None:
        return self._kind

    def accept(self, kind: str, *, recorded: bool = False) -> None:
        """``recorded``: the caller wrote ``kind`` into the record itself, with the server
        that showed it (:func:`record_server`: one durable write, not two)."""
        if self._kind == kind:
            return
        with self._lock:
            if self._kind is None:
                if not recorded:
                    _record_key(self._out_dir, "final_state", kind)
                self._kind = kind
        if self._kind != kind:
            raise IdentityError(
                f"the dump holds the {kind} final state but this dataset holds {self._kind} "
                "(provenance.json final_state); one dataset holds one kind: serve it with "
                "the same hook, or use a new output.dir",
                field="final_state",
            )


def _record_key(out_dir: Path, key: str, value: Any) -> None:
    """One learnt key added to the record, under :func:`directory_lock` like every write."""
    with directory_lock(out_dir):
        old = read_provenance(out_dir) or {"protocol": PROTOCOL_VERSION, "hsx": __version__}
        old[key] = value
        write_provenance(out_dir, orjson.dumps(old, option=orjson.OPT_INDENT_2))


def record_server(
    out_dir: Path,
    server: str,
    identity: dict[str, Any],
    job: dict[str, Any],
    *,
    final_norm: dict[str, Any] | None = None,
    final_state: str | None = None,
) -> None:
    """A server admitted to the job: its identity under ``servers`` (keyed by its URL as
    displayed), the job's under ``identity``, and the served model and server version
    in the keys older readers know (``model``, ``server``); ``final_state``: a new
    dataset's kind, learnt from this server (:class:`FinalStateGuard`). Written only when
    something changed, under :func:`directory_lock` like every write."""
    with directory_lock(out_dir):
        old = read_provenance(out_dir) or {"protocol": PROTOCOL_VERSION, "hsx": __version__}
        servers = old.get("servers") if isinstance(old.get("servers"), dict) else {}
        assert isinstance(servers, dict)
        known = servers.get(server)
        since = known.get("admitted") if isinstance(known, dict) else None
        if (
            isinstance(known, dict)
            and {k: v for k, v in known.items() if k != "admitted"} != identity
        ):
            since = None  # a new identity behind the same URL
        entry = {**identity, "admitted": since or _now()}
        new = {**old, "servers": {**servers, server: entry}, "identity": job}
        new["model"] = job.get("model") or job.get("served_as") or old.get("model", "")
        new["server"] = job.get("version") or job.get("server") or old.get("server", "")
        if final_norm is not None:
            new["final_norm"] = final_norm
        if final_state is not None:
            new["final_state"] = final_state
        if new != old:
            write_provenance(out_dir, orjson.dumps(new, option=orjson.OPT_INDENT_2))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record_input_count(out_dir: Path, samples: int) -> None:
    """Add the number of input samples (for ``hsx status``) once a run has counted them."""
    old = read_provenance(out_dir)
    if old is not None and old.get("input_samples") != samples:
        _record_key(out_dir, "input_samples", samples)


def remove_stale_temps(out_dir: Path, names: Iterable[str] = (PROVENANCE,)) -> int:
    """Delete temp files of the records ``names`` (``provenance.json``; the job report's)
    left by a process killed mid-write. Call under :func:`directory_lock`: every writer of
    those records holds it, so none is live."""
    removed = 0
    for name in names:
        for tmp in out_dir.glob(f".{name}.*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                removed += 1
    return removed


def check_shard_layout(out_dir: Path, count: int) -> None:
    """An output directory belongs to one shard layout: the one its logs were made with.
    A run with another ``[shard].count`` (or an unsharded run beside sharded ones) would
    list ids twice and delete the other run's files as orphans, so it is refused. Call it
    under :func:`directory_lock`, and create this run's logs before releasing it."""
    for kind in (MANIFEST, QUARANTINE):
        for path in log_files(out_dir, kind):
            theirs = shard_count_of(path)
            if theirs != count:
                layout = f"[shard] count = {theirs}" if theirs > 1 else "an unsharded run"
                ours = f"[shard] count = {count}" if count > 1 else "unsharded"
                raise DatasetError(
                    f"{out_dir} was made by {layout} ({path.name}); this run is {ours}. "
                    "Use another output.dir, or the directory's [shard] count"
                )


_DIR_LOCK_WAIT = 60.0


@contextlib.contextmanager
def directory_lock(out_dir: Path) -> Iterator[None]:
    """The whole output directory, briefly: held while a run checks the shard layout,
    records provenance, creates its logs and cleans orphans, so two runs starting at once
    see each other's logs. Waits for another holder up to a minute, then refuses."""
    fd = os.open(out_dir / ".hsx-dir.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + _DIR_LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DatasetError(
                        f"another hsx process has held {out_dir / '.hsx-dir.lock'} for over "
                        f"{_DIR_LOCK_WAIT:g} s; is one stopped (SIGSTOP)?"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def shard_lock_path(out_dir: Path, shard_index: int) -> Path:
    return out_dir / f".hsx-shard-{shard_index}.lock"


@contextlib.contextmanager
def shard_lock(out_dir: Path, shard_index: int) -> Iterator[None]:
    """An exclusive lock per (output dir, shard): two runs appending to one manifest
    would interleave lines and delete each other's files as orphans."""
    with exclusive_lock(
        shard_lock_path(out_dir, shard_index),
        f"another hsx process is writing shard {shard_index} of {out_dir}; stop it "
        "first, or give this run another output.dir or [shard].index",
    ):
        yield
