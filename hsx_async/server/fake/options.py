"""The fake server's configuration, fault catalogue and statistics (no I/O here)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx_async.errors import ConfigError
from hsx_async.protocol import DEFAULT_DUMP_ROOT, Storage, check_aux_layers

# Every fault makes the attempt fail on a correct client, except LATE_META, which a client
# with a long enough dump timeout must ride out.
ALL_FAULTS: tuple[str, ...] = (
    "http_500",  # 500 at once, nothing written
    "drop_before",  # connection closed without a response, nothing written
    "drop_after",  # full dump with meta.json, then the connection is closed
    "abort_dump",  # parts written, no meta.json, 200
    "late_meta",  # 200 first, meta.json late_meta_s later
    "truncated_part",  # the last part file is shorter than its name says
    "oversized_part",  # the last part file is one row longer than its name says
    "gap_parts",  # the last part is named (and listed) one row later: a gap
    "overlap_parts",  # an extra part [T-1, T) is written and listed: an overlap
    "wrong_num_tokens",  # meta.json num_tokens is T + 1
    "wrong_hidden_size",  # meta.json hidden_size is H + 1
    "wrong_layers",  # meta.json aux_layers differ from the server's
    "cached_tokens",  # response meta_info.cached_tokens > 0
    "wrong_prompt_tokens",  # response meta_info.prompt_tokens is T + 1
    "wrong_rid",  # response meta_info.id is not the request's rid
    "hang",  # never answered; released (connection closed) when the server stops
)
BENIGN_FAULTS: tuple[str, ...] = ("late_meta",)


@dataclass(frozen=True)
class FakePaths:
    """Where the fake server answers: SGLang's paths (its bodies are SGLang's whatever the
    paths; a client engine speaking them at other paths: tests/engines/standin.py)."""

    generate: str = "/generate"
    model_info: str = "/get_model_info"
    server_info: str = "/get_server_info"


@dataclass(frozen=True)
class FakeOptions:
    hidden_size: int = 64
    aux_layers: tuple[int, ...] = (1, 3, 5)
    dump_root: Path = Path(DEFAULT_DUMP_ROOT)
    model: str = "hsx-fake"
    # >0: at most this many rows of one request per forward pass (chunked prefill).
    chunk_size: int = 0
    # Split each prompt at points drawn from (seed, rid) into 1..4 parts.
    random_chunks: bool = False
    # Token budget of one simulated forward pass, shared FCFS by the waiting requests.
    max_batch_tokens: int = 16384
    # A pass costs latency_base_ms + latency_per_token_us × its rows (GPU-like).
    latency_base_ms: float = 0.0
    latency_per_token_us: float = 0.0
    # Probability that an hsx request gets one fault, drawn from (seed, rid).
    fault_rate: float = 0.0
    faults: tuple[str, ...] = ALL_FAULTS
    late_meta_s: float = 0.5
    seed: int = 0
    # Threads writing the parts of one pass (one request each at most). One tmpfs write
    # stream tops out near 1.3 GB/s, but on 2 cores a second one only steals the client's
    # CPU. 0: auto (half the cores, 1 to 4).
    writer_threads: int = 0
    # False: behave as a hook older than protocol version 3, which ignores hsx_dtype and
    # dumps bfloat16 (the client then quantizes): the fallback path, end to end.
    honour_storage: bool = True
    # False: an SGLang started without the hsx hook: a marked request is served as an
    # ordinary one (200, no dump).
    hook: bool = True
    # >0: a token id at or past it is refused with a 400, as an engine refuses an id past
    # its vocabulary (a fault of the sample's content).
    vocab_size: int = 0
    # Another checkpoint of the same shape under the same model path: other numbers.
    weights: int = 0
    # True: in every FP8 dump of the outliers layout, each part's first vector names an
    # outlier channel past the hidden size (a hook whose index arithmetic is off by one).
    bad_outliers: bool = False
    paths: FakePaths = FakePaths()

    def __post_init__(self) -> None:
        positive: dict[str, float] = {
            "hidden_size": self.hidden_size,
            "max_batch_tokens": self.max_batch_tokens,
        }
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(key, f"is {value}, expected at least 1")
        non_negative: dict[str, float] = {
            "writer_threads": self.writer_threads,
            "chunk_size": self.chunk_size,
            "latency_base_ms": self.latency_base_ms,
            "latency_per_token_us": self.latency_per_token_us,
            "late_meta_s": self.late_meta_s,
        }
        for key, value in non_negative.items():
            if value < 0:
                raise ConfigError(key, f"is {value}, expected 0 or more")
        check_aux_layers(self.aux_layers, key="aux_layers")
        check_fault_policy(self.fault_rate, self.faults)


def writer_threads(options: FakeOptions) -> int:
    if options.writer_threads > 0:
        return options.writer_threads
    return min(4, max(1, (os.cpu_count() or 1) // 2))


def check_fault_policy(fault_rate: float, faults: Sequence[str]) -> None:
    if not 0.0 <= fault_rate <= 1.0:
        raise ConfigError("fault_rate", f"is {fault_rate}, expected a probability in [0, 1]")
    unknown = sorted(set(faults) - set(ALL_FAULTS))
    if unknown:
        raise ConfigError("faults", f"unknown fault {unknown[0]!r}; known: {', '.join(ALL_FAULTS)}")


def _seeded(*parts: object) -> bytes:
    # blake2b, not hash(): stable across processes, so a run is reproducible.
    return hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=16).digest()


def draw_fault(seed: int, rid: str, fault_rate: float, faults: Sequence[str]) -> str | None:
    """The fault of one request: a pure function of (seed, rid), so a retry with a new rid
    draws afresh and a rerun of the same rids reproduces the same faults."""
    if not faults or fault_rate <= 0.0:
        return None
    digest = _seeded("fault", seed, rid)
    if int.from_bytes(digest[:8], "little") / 2.0**64 >= fault_rate:
        return None
    return faults[int.from_bytes(digest[8:], "little") % len(faults)]


def random_cuts(seed: int, rid: str, num_tokens: int) -> tuple[int, ...]:
    """Row boundaries splitting a prompt into 1..4 parts (ends with ``num_tokens``)."""
    rng = random.Random(_seeded("chunks", seed, rid))
    pieces = rng.randint(1, min(4, num_tokens))
    return (*sorted(rng.sample(range(1, num_tokens), pieces - 1)), num_tokens)


def _open_gate() -> asyncio.Event:
    gate = asyncio.Event()
    gate.set()
    return gate


@dataclass
class FakeControl:
    """The knobs a test may turn while the server runs; they survive a simulated restart."""

    fault_rate: float
    faults: tuple[str, ...]
    healthy: bool = True
    # Set: every request is answered 400 (an engine that refuses whatever it is sent).
    rejects: bool = False
    # Cleared: the scheduler forms no pass, so requests pile up in the waiting queue.
    passes_open: asyncio.Event = field(default_factory=_open_gate)


class _RidSignal:
    """Lets a test await "this rid reached state X", even if it already did.

    Remembers only the most recent rids, so a long benchmark does not grow it unbounded.
    """

    def __init__(self, keep: int = 65536) -> None:
        self._keep = keep
        self._seen: dict[str, None] = {}
        self._events: dict[str, asyncio.Event] = {}

    def mark(self, rid: str) -> None:
        self._seen[rid] = None
        if len(self._seen) > self._keep:
            del self._seen[next(iter(self._seen))]
        event = self._events.pop(rid, None)
        if event is not None:
            event.set()

    async def wait(self, rid: str) -> None:
        if rid in self._seen:
            return
        await self._events.setdefault(rid, asyncio.Event()).wait()


@dataclass
class FakeStats:
    """What the fake server saw and did; also served as JSON on ``GET /hsx_fake/stats``."""

    requests: int = 0  # every POST /generate
    hsx_requests: int = 0  # valid ones carrying custom_params.hsx_ns
    bad_requests: int = 0  # answered 400
    passes: int = 0  # simulated forward passes
    max_pass_requests: int = 0  # most requests batched into one pass
    parts_written: int = 0
    tokens_dumped: int = 0  # rows written to part files (faulty parts included)
    commits: int = 0  # meta.json files written
    fp8_requests: int = 0  # hsx requests dumped as FP8 (quantized by this server)
    storage_fallbacks: int = 0  # FP8 requests this server could not honour: dumped bf16
    restarts: int = 0
    faults: dict[str, int] = field(default_factory=dict)  # injected faults by kind
    fault_log: dict[str, str] = field(default_factory=dict)  # rid -> injected fault
    _received: _RidSignal = field(default_factory=_RidSignal, repr=False)
    _committed: _RidSignal = field(default_factory=_RidSignal, repr=False)

    def note_received(self, rid: str, fault: str | None) -> None:
        self.hsx_requests += 1
        if fault is not None:
            self.faults[fault] = self.faults.get(fault, 0) + 1
            self.fault_log[rid] = fault
        self._received.mark(rid)

    def note_storage(self, storage: Storage, why: str) -> None:
        self.fp8_requests += storage.is_fp8
        self.storage_fallbacks += bool(why)

    def note_committed(self, rid: str) -> None:
        self.commits += 1
        self._committed.mark(rid)

    async def wait_received(self, rid: str) -> None:
        """Until the server has accepted hsx request ``rid`` (and drawn its fault)."""
        await self._received.wait(rid)

    async def wait_committed(self, rid: str) -> None:
        """Until ``meta.json`` of ``rid`` is in place (the late_meta fault included)."""
        await self._committed.wait(rid)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "hsx_requests": self.hsx_requests,
            "bad_requests": self.bad_requests,
            "passes": self.passes,
            "max_pass_requests": self.max_pass_requests,
            "parts_written": self.parts_written,
            "tokens_dumped": self.tokens_dumped,
            "commits": self.commits,
            "fp8_requests": self.fp8_requests,
            "storage_fallbacks": self.storage_fallbacks,
            "restarts": self.restarts,
            "faults": dict(self.faults),
            "fault_log": dict(self.fault_log),
        }
