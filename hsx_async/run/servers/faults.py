"""Whose fault a failed attempt is: the sample's, a server's, or the job's. Pure.

Every failed attempt gets a :class:`Fault` with one of three causes, and each cause has
its own consequence (README, "Guarantees"):

- **sample** — the sample itself (the server refused its content: a 4xx such as a token
  id past the vocabulary or a prompt past the context). Only sample causes charge
  ``workers.max_attempts`` and quarantine; a refusal of the content is *permanent*: the
  same bytes get the same answer, so it is quarantined without a retry, once the server is
  shown to work (a later sample committed, or its probe passed: a storm of refusals from
  one server is that server's fault, issue 38).
- **server** — the server the attempt went to: unreachable, a 404/5xx, no hsx hook or
  connector, a timeout, a broken dump, an identity that is not the job's. The server is
  taken out of rotation (at once, or after a streak of soft faults), the sample goes back
  uncharged, and the server returns only when a probe shows it fixed
  (:mod:`hsx_async.run.servers.admission`).
- **job** — the config and the servers disagree (layers, hidden size, dump root, model,
  engine) with nothing on the config's side. Not an attempt's fault at all: the run stops
  (exit 2) before a sample is charged, with one line naming the config key
  (:mod:`hsx_async.run.servers.admission` raises it at a server's first contact).

Some server faults could still be the sample's doing — a prompt that crashes the server
every time, or times out because it is long. Those are ``reached`` faults: held as a
*suspicion* against the sample, charged only if the server is then shown to work for
another request, forgiven if it is not (:mod:`hsx_async.run.servers.retry`). Faults of requests
that never reached a server (connection refused), or that say nothing about the sample
(no hook, wrong identity, prefix cache on, 404), are never charged.

A second client of the server pool (``hsx regenerate``) classifies its errors with
:func:`fault_of` and feeds them to the same :class:`~hsx_async.run.servers.retry.Attempts`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsx_async.dataset.manifest import Cause
from hsx_async.errors import (
    AnswerError,
    CacheHitError,
    DumpError,
    DumpMissingError,
    HookMissingError,
    HsxError,
    IdentityError,
    RequestError,
    ResponseError,
)

# The kinds a fault can be (the ``kind`` label of hsx_attempts_failed_total, of the
# servers' out-of-rotation records and of quarantine lines, PROTOCOL §4): a fixed
# vocabulary, so labels stay few. Causes (``Cause``) are the quarantine line's vocabulary too.
KINDS = (
    "rejected",  # 4xx about the request's content: the sample's
    "unreachable",  # connection refused: the request never left
    "connection_lost",  # connection reset or closed mid-request
    "timeout",  # no response within server.request_timeout
    "not_found",  # 404 (or 405): the endpoint is not there (wrong engine, a proxy)
    "refused",  # 401/403/407/421: the server will not serve this client
    "throttled",  # 408/429: later
    "http_5xx",
    "bad_response",  # a response that breaks PROTOCOL §2 (ids, counts, not JSON)
    "no_hook",  # the request was served without the hsx hook/connector taking it
    "dump_missing",  # no meta.json after the response
    "bad_dump",  # a dump that breaks PROTOCOL §3 (tiling, sizes, links, changed)
    "cache_hit",  # a prefix-cache hit: the server runs with its prefix cache on
    "bad_answer",  # a decode answer no honest server gives (ids out of range, too many)
    "identity",  # the server is not the job's (shape, model, final state, hook)
)

# Statuses that say the server will not serve the request, whatever its content.
_NOT_THERE = frozenset({404, 405})
_REFUSED = frozenset({401, 403, 407, 421})
_LATER = frozenset({408, 409, 425, 429})


@dataclass(frozen=True, slots=True)
class Fault:
    """One failed attempt, attributed.

    ``evict``: the server leaves rotation at once (else after a streak of soft faults);
    ``reached``: the request reached the server and could have failed because of the
    sample (a suspicion, settled by evidence); ``permanent``: a sample fault that a retry
    cannot change (quarantined without a retry, once the server is shown to work)."""

    cause: Cause
    kind: str
    reason: str
    evict: bool = False
    reached: bool = False
    permanent: bool = False

    @property
    def charged_now(self) -> bool:
        """A sample fault: it counts against ``workers.max_attempts`` as it happens."""
        return self.cause == "sample"


def fault_of(error: HsxError) -> Fault:
    """The cause of a failed attempt's error (RequestError, DumpError and its kinds)."""
    reason = str(error)
    if isinstance(error, RequestError):
        return _request_fault(error, reason)
    if isinstance(error, IdentityError):
        return Fault("server", "identity", reason, evict=True)
    if isinstance(error, HookMissingError):
        return Fault("server", "no_hook", reason, evict=True)
    if isinstance(error, AnswerError):
        # No prompt makes an honest engine answer that: nothing it says is about the sample.
        return Fault("server", "bad_answer", reason, evict=True)
    if isinstance(error, CacheHitError):
        # The server's prefix cache skips rows: its configuration, whatever the sample.
        return Fault("server", "cache_hit", reason, evict=True)
    if isinstance(error, ResponseError):
        return Fault("server", "bad_response", reason, reached=True)
    if isinstance(error, DumpMissingError):
        return Fault("server", "dump_missing", reason, reached=True)
    if isinstance(error, DumpError):
        return Fault("server", "bad_dump", reason, reached=True)
    return Fault("server", "bad_response", reason, reached=True)


def _request_fault(error: RequestError, reason: str) -> Fault:
    status = error.status
    if status is not None:
        if status in _NOT_THERE:
            return Fault("server", "not_found", reason, evict=True)
        if status in _REFUSED:
            return Fault("server", "refused", reason, evict=True)
        if status in _LATER:
            return Fault("server", "throttled", reason)
        if 400 <= status < 500:
            return Fault("sample", "rejected", reason, permanent=True)
        return Fault("server", "http_5xx", reason, reached=True)
    if not error.reached:
        return Fault("server", "unreachable", reason, evict=True)
    if error.hard:
        return Fault("server", "connection_lost", reason, evict=True, reached=True)
    if error.timed_out:
        return Fault("server", "timeout", reason, reached=True)
    return Fault("server", "bad_response", reason, reached=True)
