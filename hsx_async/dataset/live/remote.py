"""A live reader's source on another node: ``hsx serve`` over HTTP (PROTOCOL §6.4).

The same leases and acknowledgements as a local reader, made by the server in the same
logs. A sample file travels as the manifest names it and is checked on arrival — its size
and its XXH3-64 against the manifest line — before it is read, written into a private
directory (``hsx-live-<pid>-*``, on ``/dev/shm`` when there is one) and unlinked as soon as
it is mapped, so at most ``prefetch`` files per process sit there. The directory goes with
:meth:`RemoteSource.close`, the source's collection or the end of its process (a DataLoader
worker's too); one that a killed process left is removed by the next reader that makes its
own there (:func:`sweep_caches`: its process is gone).

The HTTP itself — the connection, the secret, TLS, retries, status codes, the download —
is :class:`~hsx_async.dataset.live.transport.Transport`'s; a repeated call carries the
same ``call`` id, so the server does not apply it twice.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import re
import secrets
import shutil
import tempfile
import threading
import urllib.parse
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from hsx_async.dataset.export.plan import DatasetFacts
from hsx_async.dataset.live.ledger import AckResult
from hsx_async.dataset.live.registry import check_name
from hsx_async.dataset.live.sources import Leased
from hsx_async.dataset.live.transport import REQUEST_S, UNREACHABLE_S, Transport
from hsx_async.dataset.live.wire import (
    ACK,
    DEFAULT_TIMEOUT_S,
    FILE,
    INFO,
    LEASE,
    MAX_LEASE,
    MAX_WAIT_S,
    RELEASE,
    RENEW,
    WIRE_VERSION,
)
from hsx_async.dataset.manifest import ManifestEntry, manifest_entry
from hsx_async.errors import DatasetError
from hsx_async.protocol import Storage

log = structlog.get_logger("hsx.live")

RELEASE_S = 5.0  # a release is best effort: the leases lapse anyway
_CHUNK = 4 << 20
_TORN_RETRIES = 3
CACHE_PREFIX = "hsx-live-"
_CACHE_NAME = re.compile(rf"{CACHE_PREFIX}(\d+)-")


class Heartbeat:
    """A daemon thread that keeps one owner alive at ``hsx serve``: a renewal every
    ``timeout / 4`` seconds, for as long as the process lives (or :meth:`stop`)."""

    def __init__(self, source: RemoteSource, owner: str, timeout: float) -> None:
        self.timeout = timeout
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(weakref.ref(source), owner), name="hsx-heartbeat",
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    def _run(self, ref: weakref.ref[RemoteSource], owner: str) -> None:
        while not self._stop.wait(self.timeout / 4):
            source = ref()
            if source is None:
                return
            try:
                source.beat(owner, self.timeout)
            except (DatasetError, OSError) as exc:  # the next beat tries again
                log.warning("live_heartbeat_failed", url=source.url, error=str(exc))
            del source

    def stop(self) -> None:
        self._stop.set()


class RemoteSource:
    def __init__(
        self,
        url: str,
        consumer: str,
        *,
        cache_dir: Path | None = None,
        unreachable_timeout: float = UNREACHABLE_S,
        request_timeout: float = REQUEST_S,
        secret_file: str | Path | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        """``secret_file``: the file of hsx serve's secret (default: ``HSX_SERVE_SECRET_FILE``
        or ``HSX_SERVE_SECRET``); ``ca_file``: the CA of its ``https://`` certificate
        (default: ``HSX_SERVE_CA_FILE``, else the system's store)."""
        self._http = Transport(
            url, secret_file=secret_file, ca_file=ca_file,
            unreachable_timeout=unreachable_timeout, request_timeout=request_timeout,
        )  # fmt: skip
        self.url = self._http.url
        self.consumer = check_name(consumer)
        self._facts: DatasetFacts | None = None
        self._info_cache: dict[str, Any] | None = None
        self._heartbeat: Heartbeat | None = None
        self._cache_parent = cache_dir
        self._cache: Path | None = None
        self._removers: tuple[Any, ...] = ()  # the cache's finalizers (each runs once)
        self._chunk: memoryview | None = None  # one reused receive buffer

    def close(self) -> None:
        """Close the connection and remove the cache directory (a later fetch makes a
        new one)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        self._http.drop()
        for remove in self._removers:
            remove()
        self._cache, self._removers = None, ()

    def _call(self, path: str, owner: str, *, patience: float | None = None, **fields: Any) -> Any:
        body = {"consumer": self.consumer, "owner": owner, "call": secrets.token_hex(8), **fields}
        return self._http.json("POST", path, body, patience=patience)

    # -- the Source protocol ----------------------------------------------------------------

    def hold(self, owner: str, timeout: float) -> None:
        """Keep ``owner`` alive at serve: a heartbeat every ``timeout / 4`` from a thread of
        this process (not of the training loop: a trainer paused for a checkpoint keeps
        its samples), until :meth:`close` or the process's end."""
        if self._heartbeat is None:
            self._heartbeat = Heartbeat(self, owner, timeout)

    def beat(self, owner: str, timeout: float) -> None:
        self._call(RENEW, owner, patience=timeout / 2, timeout=timeout)

    def lease(self, owner: str, rank: int, epoch: int, count: int) -> Leased:
        timeout = self._heartbeat.timeout if self._heartbeat else DEFAULT_TIMEOUT_S
        answer = self._call(
            LEASE, owner, rank=rank, epoch=epoch, count=min(count, MAX_LEASE),
            timeout=timeout, wait=MAX_WAIT_S / 2,
        )  # fmt: skip
        entries = [manifest_entry(rec, f"{self.url}{LEASE}") for rec in answer["entries"]]
        return Leased(entries, ended=bool(answer["ended"]))

    def ack(
        self, owner: str, epoch: int, ids: Sequence[str], *, adopted_from: str | None = None
    ) -> AckResult:
        fields: dict[str, Any] = {"epoch": epoch, "ids": list(ids)}
        if adopted_from is not None:
            fields["from"] = adopted_from
        answer = self._call(ACK, owner, **fields)
        refused = answer.get("refused") or {}
        acked = [i for i in ids if i not in refused]
        return AckResult(acked=acked, refused={str(k): str(v) for k, v in refused.items()})

    def release(self, owner: str, epoch: int, ids: Sequence[str]) -> None:
        """Best effort (a reader stopping early): its leases end with it anyway."""
        self._call(RELEASE, owner, patience=RELEASE_S, epoch=epoch, ids=list(ids))

    def identity(self) -> str:
        return str(self._info()["dataset"])

    def fetch(self, owner: str, epoch: int, entry: ManifestEntry) -> tuple[Path, bool]:
        """The sample file, whole and as its manifest line hashes it, in the cache (only
        the holder of its lease gets it)."""
        target = self._cache_dir() / f".{secrets.token_hex(8)}.safetensors"
        fields = {"path": entry.path, "consumer": self.consumer, "owner": owner, "epoch": epoch}
        query = f"{FILE}?{urllib.parse.urlencode(fields)}"
        for _ in range(_TORN_RETRIES):
            digest = self._http.retrying(
                f"GET {entry.path}",
                lambda: self._http.download(query, entry.path, entry.size, target, self._buffer()),
            )
            if digest == entry.xxh3_64:
                return target, True
            target.unlink(missing_ok=True)  # changed on the way: again
        raise DatasetError(
            f"{self.url}: {entry.path} arrived {_TORN_RETRIES} times with another XXH3-64 "
            f"than its manifest line ({entry.xxh3_64}); run hsx verify on the serving node"
        )

    def _buffer(self) -> memoryview:
        if self._chunk is None:
            self._chunk = memoryview(bytearray(_CHUNK))
        return self._chunk

    def _info(self) -> dict[str, Any]:
        if self._info_cache is None:
            info = self._http.json("GET", INFO)
            if info.get("protocol") != WIRE_VERSION:
                raise DatasetError(
                    f"{self.url} speaks protocol {info.get('protocol')!r}, this reader "
                    f"{WIRE_VERSION}: run the same hsx version on both nodes"
                )
            self._info_cache = info
        return self._info_cache

    def facts(self, entry: ManifestEntry) -> DatasetFacts:
        if self._facts is None:
            f = self._info()["facts"]
            aux = f.get("aux_layers")
            storage = f.get("storage") or {}
            self._facts = DatasetFacts(
                aux_layers=None if aux is None else tuple(aux),
                hidden_size=f.get("hidden_size"),
                final_state=f["final_state"],
                provenance=f.get("provenance"),
                storage=Storage(
                    storage.get("dtype", "bfloat16"), tuple(storage.get("quantized", ()))
                ),
            )
        return self._facts

    def _cache_dir(self) -> Path:
        if self._cache is None:
            parent = self._cache_parent or _default_cache_parent()
            parent.mkdir(parents=True, exist_ok=True)
            sweep_caches(parent)
            cache = Path(tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{os.getpid()}-", dir=parent))
            self._removers = (
                weakref.finalize(self, shutil.rmtree, cache, True),  # collected, or at exit
                # a DataLoader worker ends without atexit; multiprocessing runs these
                multiprocessing.util.Finalize(
                    None, shutil.rmtree, args=(cache, True), exitpriority=0
                ),
            )
            self._cache = cache
        return self._cache


def sweep_caches(parent: Path) -> list[Path]:
    """Remove the cache directories in ``parent`` that this user's processes left and
    that no process of theirs owns any longer (a reader killed with SIGKILL); the removed.
    A process of another user, or one this one cannot see, keeps its directory."""
    removed = []
    with contextlib.suppress(OSError):
        for path in parent.iterdir():
            match = _CACHE_NAME.match(path.name)
            if match is None or int(match[1]) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if path.lstat().st_uid != os.getuid() or _alive(int(match[1])):
                    continue
                shutil.rmtree(path)
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _default_cache_parent() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
