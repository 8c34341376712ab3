"""The hsx error tree. Every message says what the operator should change.

::

    HsxError
    ├── ConfigError            a config file or option is wrong (names the key and the fix)
    ├── InputError             the input file cannot be read at all
    ├── DumpError              one attempt's dump or response breaks PROTOCOL §2–3 (retried)
    ├── RequestError           one attempt's HTTP call failed (retried)
    ├── NoServerError          no server has been reachable for too long
    ├── DatasetError           the output directory is inconsistent or belongs to another run
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
    """A response or dump violates the protocol; the attempt is retried, then quarantined."""


class RequestError(HsxError):
    """An HTTP call failed (connection error, timeout, HTTP error); the attempt is retried.

    ``server_fault``: the server, not the request, is to blame (5xx, timeout, connection);
    ``hard``: the connection itself failed, so the server leaves rotation at once.
    """

    def __init__(self, message: str, *, server_fault: bool = True, hard: bool = False) -> None:
        self.server_fault = server_fault
        self.hard = hard
        super().__init__(message)


class NoServerError(HsxError):
    """No configured server answered ``/health`` within the allowed time."""


class DatasetError(HsxError):
    """The output directory cannot be used as it is."""


class WriteError(HsxError):
    """A dataset file could not be written, synced or renamed."""


class DiskFullError(WriteError):
    """The output file system is full."""


class ForcedExit(HsxError):
    """A second SIGTERM/SIGINT: leave now. The dataset stays resumable."""
