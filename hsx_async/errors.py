"""The hsx error tree. Every message says what the operator should change.

::

    HsxError
    ├── ConfigError            a config file or option is wrong (names the key and the fix)
    ├── InputError             the input file cannot be read at all
    ├── DumpError              one attempt's dump or response breaks PROTOCOL §2–3 (retried)
    │   ├── ResponseError      the response breaks PROTOCOL §2 (ids, token counts)
    │   │   ├── CacheHitError  the response reports a prefix-cache hit (rows skipped)
    │   │   ├── HookMissingError  served without the hsx hook/connector taking it
    │   │   └── AnswerError    a regenerate answer the request cannot have had (ids)
    │   ├── DumpMissingError   no meta.json appeared after the response
    │   └── IdentityError      the server is not the job's (shape, model, final state, ...)
    ├── HsxRequestError        a marked request breaks PROTOCOL §2 (server side: nothing dumped)
    ├── RequestError           one attempt's HTTP call failed (retried)
    ├── NoServerError          no server has been reachable for too long
    ├── DatasetError           the output directory is inconsistent or belongs to another run
    │   └── LiveError          a live reader cannot go on (no sample for too long, server gone)
    ├── WriteError             a dataset file could not be written durably
    │   └── DiskFullError      ENOSPC: free space or lower the reserve
    └── ForcedExit             a second stop signal: exit now (resume stays safe)
"""

from __future__ import annotations


class HsxError(Exception):
    """Base class of every error hsx raises on purpose."""


class ConfigError(HsxError):
    """A configuration key is missing, unknown or invalid."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"config key {key!r}: {message}" if key else message)


class ArgumentError(ConfigError):
    """A command-line argument is invalid, named as it is typed (``--workers``, ``INPUT``)."""

    def __init__(self, argument: str, message: str) -> None:
        HsxError.__init__(self, f"argument {argument}: {message}")
        self.key = argument


class InputError(HsxError):
    """The input JSONL cannot be opened or read."""


class DumpError(HsxError):
    """A response or dump violates the protocol; the attempt fails (whose fault it is:
    :mod:`hsx_async.run.servers.faults`)."""


class ResponseError(DumpError):
    """The server's answer to a marked request breaks PROTOCOL §2."""


class CacheHitError(ResponseError):
    """The answer reports cached prompt tokens: the server runs with its prefix cache on."""


class HookMissingError(ResponseError):
    """The server answered a marked request without the hsx hook or connector taking it
    (vLLM without ``--kv-transfer-config``): a server fault, never the sample's."""


class AnswerError(ResponseError):
    """A decode answer (``hsx regenerate``) breaks its request: not the engine's answer
    form, a token id outside the tokenizer's vocabulary, more ids than ``max_new_tokens``.
    The server's fault: the answer is never written."""


class DumpMissingError(DumpError):
    """No ``meta.json`` appeared within ``dump.timeout`` after the response."""


class IdentityError(DumpError):
    """What a server reports (at first contact or in a ``meta.json``) is not what this job
    is made of. ``key``: the config key it contradicts ('' when it contradicts the
    dataset or the other servers rather than the config); ``field``: what differs."""

    def __init__(self, message: str, *, key: str = "", field: str = "") -> None:
        self.key = key
        self.field = field
        super().__init__(message)


class HsxRequestError(HsxError):
    """A request marked for a dump (``hsx_ns``) breaks PROTOCOL §2: its namespace or rid
    does not match its pattern, or it is not prefill-only. Raised by the one rule every hook
    and server calls (:func:`hsx_async.protocol.check_hsx_request`); nothing is dumped for
    the request, and a server that can answers 400 with the message."""


class RequestError(HsxError):
    """An HTTP call failed (connection error, timeout, HTTP error); the attempt fails.

    ``server_fault``: the server, not the request, is to blame (5xx, timeout, connection);
    ``hard``: the connection itself failed, so the server leaves rotation at once;
    ``status``: the HTTP status, when one came; ``reached``: False when the request
    provably never reached the server (the connection was refused); ``timed_out``: no
    response within the request's timeout.
    """

    def __init__(
        self,
        message: str,
        *,
        server_fault: bool = True,
        hard: bool = False,
        status: int | None = None,
        reached: bool = True,
        timed_out: bool = False,
    ) -> None:
        self.server_fault = server_fault
        self.hard = hard
        self.status = status
        self.reached = reached
        self.timed_out = timed_out
        super().__init__(message)


class NoServerError(HsxError):
    """No configured server answered ``/health`` within the allowed time."""


class DatasetError(HsxError):
    """The output directory cannot be used as it is."""


class LiveError(DatasetError):
    """A live dataset reader gave up: nothing arrived within its wait, or its server stayed
    unreachable past the deadline. Its leases lapse; a restart goes on where it stopped."""


class WriteError(HsxError):
    """A dataset file could not be written, synced or renamed."""


class DiskFullError(WriteError):
    """The output file system is full."""


class ForcedExit(HsxError):
    """A second SIGTERM/SIGINT: leave now. The dataset stays resumable."""


def first_error(group: BaseExceptionGroup[HsxError]) -> HsxError:
    """The first error of a task group's exception group: the one the operator must act
    on (what ``hsx run`` and ``hsx regenerate`` raise when their group fails)."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, HsxError)
    return exc
