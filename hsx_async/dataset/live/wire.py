"""The online transport's contract (PROTOCOL §6.4): ``hsx serve`` on the node that holds a
dataset, live readers on other nodes. Pure: both sides parse through these functions.

Every endpoint is bounded: request bodies at most :data:`MAX_BODY` bytes, a lease at most
:data:`MAX_LEASE` samples, an ack at most :data:`MAX_IDS` ids, a lease's long poll at most
:data:`MAX_WAIT_S`, and a sample file exactly the bytes its manifest line names. Times are
durations, never wall-clock instants: the server turns them into instants with its own
clock, so the nodes' clocks need not agree.

- ``GET /v1/info`` → ``{"protocol", "dataset", "facts", "registry"}`` (the dataset's
  identity; the dataset as the export sees it: aux layers, hidden size, final state,
  storage, provenance; the registry in force).
- ``POST /v1/lease`` ``{consumer, owner, rank, epoch, count, timeout, wait, call}`` →
  ``{"entries": [manifest lines], "ended": bool}``: up to ``count`` samples leased to the
  owner while it lives — while serve hears from it at least every ``timeout`` s; while
  none is available the server waits up to ``wait`` s for one (holding no lock).
- ``GET /v1/file?path=data/…&consumer=…&owner=…&epoch=…`` → the sample file, to the
  owner that holds its lease (410 when it no longer does), ``Content-Length`` its size;
  the reader checks its XXH3-64.
- ``POST /v1/ack`` ``{consumer, owner, epoch, ids, call, from?}`` → ``{"acked", "again",
  "refused": {id: reason}}``: durable when answered; only the holder of a sample's lease
  (or, with ``from``, an owner it was delivered to) acknowledges it.
- ``POST /v1/release`` ``{consumer, owner, epoch, ids, call}``, ``POST /v1/renew``
  ``{consumer, owner, timeout, call}`` (the heartbeat) → ``{}``.

``call`` (a random id per call, 16–32 hex digits) lets a reader repeat a call whose answer
it lost: the server answers a repeated ``call`` with the answer it gave — from memory, or
after a restart from the consumer's log, where each lease and ack records its call — so a
retried lease hands over the same samples and a retried ack is not counted twice. 4xx:
the request is wrong (not retried; 409: a replaced owner or an unregistered consumer; 410:
a sample no longer the owner's); 5xx and lost connections: retried.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hsx_async.dataset.live.ledger import check_owner
from hsx_async.dataset.live.registry import check_name
from hsx_async.errors import DatasetError

WIRE_VERSION = 6  # the PROTOCOL version that defines it
MAX_BODY = 1 << 20  # bytes of a request body (an ack of MAX_IDS long ids)
MAX_RESPONSE = 8 << 20  # bytes of a JSON answer (a lease's manifest lines, the facts)
MAX_LEASE = 256
MAX_IDS = 4096
MAX_WAIT_S = 10.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0
REPLAY = 64  # answers kept per owner for repeated calls
GONE = 410  # a file or sample no longer this owner's (its lease ended): skipped
VOID_STATUS = 409  # a replaced owner, or a consumer that is not registered
MAX_HOLDERS = 1024  # live owners per consumer at one serve
DEFAULT_TIMEOUT_S = 600.0  # an owner not heard from this long is dead (serve lets go)
MIN_TIMEOUT_S = 1.0  # the shortest heartbeat timeout a reader may ask for
_CALL = re.compile(r"[0-9a-f]{16,32}")
INFO, LEASE, FILE, ACK, RELEASE, RENEW = (
    "/v1/info",
    "/v1/lease",
    "/v1/file",
    "/v1/ack",
    "/v1/release",
    "/v1/renew",
)


class WireError(DatasetError):
    """A request or answer that breaks the contract (a 4xx on the server side)."""


def _int(raw: dict[str, Any], key: str, low: int, high: int) -> int:
    value = raw.get(key)
    if type(value) is not int or not low <= value <= high:
        raise WireError(f"{key!r} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _seconds(raw: dict[str, Any], key: str, high: float) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
        raise WireError(f"{key!r} must be a number of seconds in [0, {high}], got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks: a consumer's owner (one incarnation of one rank) and the call's id."""

    consumer: str
    owner: str
    call: str


def caller(raw: Any) -> Caller:
    if not isinstance(raw, dict):
        raise WireError("the body must be a JSON object")
    try:
        consumer, owner = check_name(raw.get("consumer")), check_owner(raw.get("owner"))
    except DatasetError as exc:
        raise WireError(str(exc)) from None
    call = raw.get("call")
    if not isinstance(call, str) or not _CALL.fullmatch(call):
        raise WireError(f"'call' must be 16–32 lowercase hex digits, got {call!r}")
    return Caller(consumer, owner, call)


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    rank: int
    epoch: int
    count: int
    timeout: float
    wait: float


def lease_request(raw: dict[str, Any]) -> LeaseRequest:
    return LeaseRequest(
        rank=_int(raw, "rank", 0, 1 << 20),
        epoch=_int(raw, "epoch", 0, 1 << 20),
        count=_int(raw, "count", 1, MAX_LEASE),
        timeout=heartbeat_timeout(raw),
        wait=_seconds(raw, "wait", MAX_WAIT_S),
    )


def heartbeat_timeout(raw: dict[str, Any]) -> float:
    """Seconds serve keeps an owner alive without hearing from it."""
    return max(_seconds(raw, "timeout", MAX_TIMEOUT_S), MIN_TIMEOUT_S)


def adopted_from(raw: dict[str, Any]) -> str | None:
    """The earlier owner an ack speaks for (a checkpoint's), if any."""
    value = raw.get("from")
    if value is None:
        return None
    try:
        return check_owner(value)
    except DatasetError as exc:
        raise WireError(f"'from': {exc}") from None


@dataclass(frozen=True, slots=True)
class FileRequest:
    consumer: str
    owner: str
    epoch: int


def file_request(query: Any) -> FileRequest:
    """``GET /v1/file``'s query: the owner whose lease the file is under (its ``path`` is
    checked first, by :meth:`LiveServer.sample_file`, for the 400/404 order)."""
    try:
        consumer, owner = check_name(query.get("consumer")), check_owner(query.get("owner"))
    except DatasetError as exc:
        raise WireError(str(exc)) from None
    epoch = query.get("epoch", "")
    if not (isinstance(epoch, str) and epoch.isdecimal() and int(epoch) <= 1 << 20):
        raise WireError(f"'epoch' must be an integer in [0, {1 << 20}], got {epoch!r}")
    return FileRequest(consumer, owner, int(epoch))


def id_list(raw: dict[str, Any]) -> tuple[int, list[str]]:
    """(epoch, ids) of an ack or release."""
    ids = raw.get("ids")
    if not isinstance(ids, list) or len(ids) > MAX_IDS:
        raise WireError(f"'ids' must be a list of at most {MAX_IDS} sample ids")
    if not all(isinstance(i, str) and 0 < len(i) <= 4096 for i in ids):
        raise WireError("'ids' must hold sample ids as strings")
    return _int(raw, "epoch", 0, 1 << 20), ids
