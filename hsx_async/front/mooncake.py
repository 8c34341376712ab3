"""A sample published to Mooncake Store as hs-connectors 0.9.0's reader takes it.

Read from hs-connectors 0.9.0 (``hs_connectors/mooncake_store.py``, and the vLLM side's
``mooncake_hidden_states_connector.py``): one raw object per sample at its ``handle``, the
tensors packed back to back in manifest order, each section starting at a multiple of 64
bytes; the manifest (``{handle, version: 1, tensors: {name: {shape, dtype, nbytes,
offset}}, metadata: {num_tokens, total_aligned_bytes, extract_mode}}``) travels in the
completion's ``kv_transfer_params``. A failure is a small JSON object ``{"error": reason}``
at ``{handle}:error``, which the reader checks before the data.

Unlike hs-connectors' own producer, every object is put **hard-pinned**: Mooncake's master
evicts unpinned objects once a segment is ~90 % full, and the trainer would then wait out
its 120 s timeout on a sample that was published (measured: 15 unpinned 4 MiB objects in a
64 MiB segment, 2 gone 3 s later; pinned, none). The trainer removes each object once it has
read it (``remove(key, force=True)``). Objects live in the segment of the client that put
them: this process must stay up until they are read.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import torch

from hsx_async.errors import HsxError

VERSION = 1  # hs-connectors' manifest version
ALIGN = 64
ERROR_SUFFIX = ":error"
MAX_REASON = 4096  # hs-connectors truncates its own reasons there
# Mooncake's status codes met here (mooncake-transfer-engine 0.3.13).
NO_SPACE = -200  # the segments cannot hold the object (pinned objects are never evicted)
NO_BUFFER = -600  # the object is larger than the client's local buffer
OBJECT_NOT_FOUND = -704  # a remove of a key that is not there
RPC_FAIL = -900  # the master did not answer (it is down, or unreachable from here)
MIN_SEGMENT = 16 << 20  # Mooncake refuses a smaller segment ("Total size must be at least")


# What a refusal was (the ``kind`` of the front's failure metrics).
FULL = "mooncake_full"
TOO_LARGE = "mooncake_too_large"
UNREACHABLE = "mooncake_unreachable"
PUT_FAILED = "mooncake_put"


class MooncakeError(HsxError):
    """Mooncake refused a call; the message names the status and what to change."""

    def __init__(self, message: str, kind: str = PUT_FAILED) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class MooncakeOptions:
    master: str  # the master's HOST:PORT
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device: str = ""
    segment_bytes: int = 1 << 30  # this process's segment: where its samples live
    buffer_bytes: int = 256 << 20  # the client's local buffer: the largest sample it puts


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def pack(handle: str, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], bytes]:
    """The manifest and the object's bytes: each tensor's bytes at a 64-byte aligned offset,
    in the order given (hs-connectors' ``packed_layout``)."""
    specs: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        specs[name] = {
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype),
            "nbytes": len(raw),
            "offset": offset,
        }
        end = aligned(offset + len(raw))
        chunks.append(raw + bytes(end - offset - len(raw)))
        offset = end
    num_tokens = math.prod(tensors["token_ids"].shape) if "token_ids" in tensors else 0
    manifest = {
        "handle": handle,
        "version": VERSION,
        "tensors": specs,
        "metadata": {
            "num_tokens": num_tokens,
            "total_aligned_bytes": offset,
            "extract_mode": "prompt_only",
        },
    }
    return manifest, b"".join(chunks)


def error_manifest(handle: str) -> dict[str, Any]:
    """What ``kv_transfer_params`` says for a failed sample: the reader finds the marker
    before it looks at any tensor."""
    return {
        "handle": handle,
        "version": VERSION,
        "tensors": {},
        "metadata": {"num_tokens": 0, "total_aligned_bytes": 0, "extract_mode": "prompt_only"},
    }


def error_payload(reason: str) -> bytes:
    return orjson.dumps({"error": reason[:MAX_REASON]})


class Publisher:
    """One Mooncake Store client (with its segment) that puts samples and error markers.
    Its calls block: run them in a thread."""

    def __init__(self, options: MooncakeOptions) -> None:
        if options.segment_bytes < MIN_SEGMENT:
            raise MooncakeError(
                f"a Mooncake segment of {options.segment_bytes} bytes is below Mooncake's "
                f"least ({MIN_SEGMENT} bytes): raise --mooncake-segment-mib to 16 or more"
            )
        try:
            from mooncake.store import (  # noqa: PLC0415
                MooncakeDistributedStore,
                ReplicateConfig,
            )
        except ImportError as exc:
            raise MooncakeError(
                f"Mooncake is not installed ({exc}): pip install "
                "mooncake-transfer-engine-non-cuda (or -cuda), plus Debian's libibverbs1 "
                "libnl-3-200 libnl-route-3-200 (bash .ci/mooncake-env builds .venv-mooncake)"
            ) from None
        self.options = options
        store = MooncakeDistributedStore()
        status = store.setup(
            options.local_hostname,
            options.metadata_server,
            options.segment_bytes,
            options.buffer_bytes,
            options.protocol,
            options.device,
            options.master,
        )
        if status != 0:
            raise MooncakeError(
                f"Mooncake setup failed with status {status}: is mooncake_master running at "
                f"{options.master} (--mooncake-master), and can this host give the segment "
                f"({options.segment_bytes} bytes) and buffer ({options.buffer_bytes} bytes)?"
            )
        self._store: Any = store
        # Hard-pinned, in this client's own segment: Mooncake spills an object that does not
        # fit into any other mounted segment (a trainer's client's), and it is gone when
        # that client leaves; such a put is taken back and refused as full (_check_placed).
        self.segment = store.get_hostname()
        self._pinned: Any = ReplicateConfig()
        self._pinned.with_hard_pin = True
        self._pinned.preferred_segment = self.segment
        # What this client put and the trainer may not have removed yet: key -> bytes.
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()
        try:
            self.endpoint = self._own_endpoint()
        except BaseException:
            store.close()
            raise
        # A put stages its bytes in the client's local buffer: concurrent puts together
        # past it are refused (NO_BUFFER), so they wait for room (each alone fits).
        self._room = threading.Condition()
        self._staging = 0

    def held(self) -> tuple[int, int]:
        """(objects, bytes) put and not yet removed, as last refreshed."""
        with self._lock:
            return len(self._held), sum(self._held.values())

    def taken(self, keys: list[str]) -> list[str]:
        """Those of ``keys`` Mooncake holds now (a put there would keep the old bytes and
        answer 0)."""
        present = self._store.batch_is_exist(keys)
        return [key for key, there in zip(keys, present, strict=True) if there == 1]

    def refresh_held(self) -> None:
        """Forget what the trainer has removed (one batched lookup at the master)."""
        with self._lock:
            keys = list(self._held)
        if not keys:
            return
        present = self._store.batch_is_exist(keys)
        with self._lock:
            for key, there in zip(keys, present, strict=True):
                if there == 0:  # 1: there; negative: the lookup failed (kept, seen next time)
                    self._held.pop(key, None)

    def put_sample(self, handle: str, blob: bytes) -> None:
        """Put the packed sample at ``handle``, hard-pinned; :class:`MooncakeError` with
        what to change when Mooncake refuses it."""
        if len(blob) > self.options.buffer_bytes:
            raise MooncakeError(
                f"the sample is {len(blob)} bytes, over the Mooncake client's local buffer "
                f"({self.options.buffer_bytes} bytes): raise --mooncake-buffer-mib",
                TOO_LARGE,
            )
        self._put(handle, blob)

    def put_error(self, handle: str, reason: str) -> None:
        self._put(handle + ERROR_SUFFIX, error_payload(reason))

    def _staged_put(self, key: str, blob: bytes, room: int) -> int:
        """One put once ``room`` bytes of the local buffer are free of other puts'."""
        with self._room:
            self._room.wait_for(lambda: self._staging + room <= self.options.buffer_bytes)
            self._staging += room
        try:
            status: int = self._store.put(key, blob, self._pinned)
        finally:
            with self._room:
                self._staging -= room
                self._room.notify_all()
        return status

    def _put(self, key: str, blob: bytes) -> None:
        status = self._staged_put(key, blob, min(len(blob), self.options.buffer_bytes))
        if status == NO_BUFFER:  # the others' bytes left no room in one piece: once, alone
            status = self._staged_put(key, blob, self.options.buffer_bytes)
        if status == 0:
            self._check_placed(key, len(blob))
            with self._lock:
                self._held[key] = len(blob)
            return
        if status == NO_SPACE:
            raise MooncakeError(
                f"Mooncake is full (status {status}) for {key} ({len(blob)} bytes): the "
                "trainer has not removed what it read, or --mooncake-segment-mib is too small",
                FULL,
            )
        if status == RPC_FAIL:
            raise MooncakeError(
                f"Mooncake's master at {self.options.master} did not answer the put of {key} "
                f"(status {status}): is mooncake_master running (--mooncake-master)?",
                UNREACHABLE,
            )
        raise MooncakeError(f"Mooncake put of {key} ({len(blob)} bytes) failed: status {status}")

    def _own_endpoint(self) -> str:
        """Where Mooncake says this client's segment is (an object's replica names its
        transfer endpoint, not the segment's name): a probe put there, then removed."""
        key = f"hsx-front-probe/{self.segment}"
        status = self._store.put(key, b"\0", self._pinned)
        if status != 0:
            raise MooncakeError(f"Mooncake put of its probe object failed: status {status}")
        try:
            [endpoint] = self._hosts(key)
        finally:
            self._store.remove(key, True)
        return endpoint

    def _hosts(self, key: str) -> set[str]:
        return {
            replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
            for replica in self._store.get_replica_desc(key)
            if replica.is_memory_replica()
        }

    def _check_placed(self, key: str, size: int) -> None:
        """:class:`MooncakeError` (full) after taking ``key`` back when Mooncake placed it
        outside this client's segment (asking where takes no read lease)."""
        hosts = self._hosts(key)
        if hosts == {self.endpoint}:
            return
        self._store.remove(key, True)
        raise MooncakeError(
            f"Mooncake is full for {key} ({size} bytes): this front's segment ({self.endpoint}) "
            f"has no room and Mooncake placed it with {sorted(hosts)}, whose segment leaves "
            "with its client; the trainer has not removed what it read, or "
            "--mooncake-segment-mib is too small",
            FULL,
        )

    def remove(self, key: str) -> bool:
        """Remove ``key`` if this client's puts hold it (forced: past Mooncake's read
        leases); False when Mooncake refused."""
        status = self._store.remove(key, True)
        with self._lock:
            self._held.pop(key, None)
        return status in (0, OBJECT_NOT_FOUND)

    def close(self) -> None:
        """Unmount the segment: the objects still in it are gone."""
        self._store.close()
