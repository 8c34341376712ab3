"""systemd's notify protocol (``sd_notify``) without libsystemd.

Under ``Type=notify`` systemd passes ``$NOTIFY_SOCKET``, a datagram socket on which the
service reports its state as newline-separated ``KEY=VALUE`` lines: ``READY=1`` once it
serves, ``STATUS=...`` for ``systemctl status``, ``WATCHDOG=1`` as a keep-alive when the
unit sets ``WatchdogSec=``, ``RELOADING=1`` / ``STOPPING=1`` around a reload or a stop.

Outside systemd (a terminal, a container, a Slurm job) the variable is unset and every
method does nothing. Sending never raises: a notify socket that went away must not end a
70-hour extraction, so a failed send is logged at debug level and forgotten.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping

import structlog

log = structlog.get_logger("hsx.notify")

# AF_UNIX addresses are at most 108 bytes (sun_path) on Linux.
_MAX_ADDRESS = 108


def parse_address(value: str) -> str | None:
    """The ``sendto`` address of a ``$NOTIFY_SOCKET`` value, or None when unusable.

    ``@name`` is a Linux abstract socket (a leading NUL byte on the wire); ``/path`` is a
    socket file. systemd hands out nothing else that AF_UNIX can reach (``vsock:`` needs
    AF_VSOCK), so anything else disables notification rather than guessing.
    """
    if value.startswith("@") and len(value) > 1:
        address = "\0" + value[1:]
    elif value.startswith("/"):
        address = value
    else:
        return None
    if len(address.encode()) > _MAX_ADDRESS:
        return None
    return address


def parse_watchdog_usec(env: Mapping[str, str], pid: int) -> int | None:
    """``$WATCHDOG_USEC`` when the watchdog is meant for this process, else None.

    ``$WATCHDOG_PID``, when present, names the process that must ping; a child that
    inherited the environment must not take over its parent's watchdog.
    """
    owner = env.get("WATCHDOG_PID")
    if owner is not None and owner.strip() != str(pid):
        return None
    raw = env.get("WATCHDOG_USEC")
    if raw is None:
        return None
    try:
        usec = int(raw)
    except ValueError:
        return None
    return usec if usec > 0 else None


def _one_line(text: str) -> str:
    # A newline would start a new KEY=VALUE assignment inside the datagram.
    return " ".join(text.splitlines())


def _monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends service state to systemd; a silent no-op when not started by it.

    Build it with :meth:`from_env` at start-up. Not thread-safe by design: the daemon
    calls it from its event loop only.

    A state change (READY, RELOADING, STOPPING) that finds the receiver's queue full
    (EAGAIN) is kept and sent again before the next message (the next watchdog tick at
    the latest):
    a lost ``READY=1`` would make systemd kill the service at ``TimeoutStartSec``. Only
    the latest state is kept; a lost STATUS or WATCHDOG is simply replaced by the next.
    """

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        """``address``: as :func:`parse_address` returns it (None disables everything)."""
        self._address = address
        self._watchdog_usec = watchdog_usec if address is not None else None
        self._sock: socket.socket | None = None
        self._pending_state: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` (default: os.environ)."""
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        address = parse_address(raw) if raw else None
        if raw and address is None:
            log.warning("notify_socket_unusable", notify_socket=raw)
        return cls(address, parse_watchdog_usec(env, os.getpid()))

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between ``WATCHDOG=1`` pings (half of ``WatchdogSec``), or None if off."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 1e6 / 2

    def ping_interval(self, progress_interval: float) -> float:
        """How often :func:`watchdog_loop` should run: the progress interval, shortened to
        the watchdog's when that is tighter."""
        wd = self.watchdog_interval
        return progress_interval if wd is None else min(progress_interval, wd)

    def ready(self) -> None:
        self._send_state("READY=1")

    def status(self, text: str) -> None:
        self.send(f"STATUS={_one_line(text)}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self) -> None:
        self._send_state("STOPPING=1")

    def reloading(self) -> None:
        """Start of a SIGHUP reload; send :meth:`ready` again when it is done.

        ``MONOTONIC_USEC`` lets systemd (≥ 253) tell this reload from an older one.
        """
        self._send_state(f"RELOADING=1\nMONOTONIC_USEC={_monotonic_usec()}")

    def send(self, message: str) -> bool:
        """Send one datagram (after a pending state change, if any); True if it left."""
        address = self._address
        if address is None:
            return False
        pending = self._pending_state
        if pending is not None and self._send_now(address, pending) is None:
            self._pending_state = None
        return self._send_now(address, message) is None

    def close(self) -> None:
        """Last try at a pending state change (often STOPPING=1), then release the socket."""
        if self._address is not None and self._pending_state is not None:
            self._send_now(self._address, self._pending_state)
            self._pending_state = None
        self._drop_socket()

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send_state(self, message: str) -> None:
        if self._address is None:
            return
        self._pending_state = None  # superseded: only the latest state matters
        if isinstance(self._send_now(self._address, message), BlockingIOError):
            self._pending_state = message

    def _send_now(self, address: str, message: str) -> OSError | None:
        """Send, or return why not. EAGAIN: the receiver's queue is full. ECONNREFUSED or
        ENOENT: systemd is gone or the socket moved. Either way the job must go on."""
        try:
            sock = self._socket()
            sock.sendto(message.encode(), address)
        except OSError as exc:
            log.debug("notify_send_failed", message=message, error=str(exc))
            if not isinstance(exc, BlockingIOError):
                self._drop_socket()  # start afresh next time
            return exc
        return None

    def _socket(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Never block the event loop on a slow or stuck receiver.
            sock.setblocking(False)
            self._sock = sock
        return self._sock


Sleep = Callable[[float], Awaitable[None]]


def _status_line(status_fn: Callable[[], str]) -> str | None:
    try:
        return status_fn()
    except Exception:  # a bug in the progress line must not stop the keep-alive
        log.warning("notify_status_failed", exc_info=True)
        return None


async def watchdog_loop(
    notifier: Notifier,
    interval: float | Callable[[], float],
    status_fn: Callable[[], str],
    *,
    sleep: Sleep = asyncio.sleep,
) -> None:
    """Send ``WATCHDOG=1`` (when the unit has a watchdog) and ``STATUS=<status_fn()>``
    every ``interval`` seconds, forever (a callable is asked before each sleep, so a
    reload can change it).

    Meant to run in the daemon's TaskGroup until cancelled. It runs on the event loop on
    purpose: if the loop stalls, the pings stop and systemd's watchdog restarts a hung
    daemon. Returns at once when systemd is not listening. ``sleep`` is injectable so
    tests can drive iterations without waiting.
    """

    def seconds() -> float:
        value = interval() if callable(interval) else interval
        if value <= 0:
            raise ValueError(f"watchdog_loop interval must be positive, got {value}")
        return value

    seconds()  # a bad interval fails at once, even with no systemd listening
    if not notifier.enabled:
        return
    pings = notifier.watchdog_interval is not None
    while True:
        if pings:
            notifier.watchdog()
        line = _status_line(status_fn)
        if line is not None:
            notifier.status(line)
        await sleep(seconds())
