"""Network addresses: the rule of every ``HOST:PORT`` listen setting (``--listen``,
``[daemon].metrics_listen``), one place for the run, ``hsx serve`` and the config."""

from __future__ import annotations

import errno
import ipaddress
import socket


def listen_ok(value: str) -> bool:
    """HOST:PORT (or "": none), the rule of every --listen and *_listen."""
    if value == "":
        return True
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isascii() and port.isdecimal() and int(port) < 65536)


def listen_address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


def loopback_host(host: str) -> bool:
    """Whether ``host`` (of a listen address) reaches this machine only: ``localhost`` or a
    loopback IP. Any other name may resolve to an interface other nodes reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listen_problem(listen: str) -> str:
    """'' when ``daemon.metrics_listen`` can be bound now (or is "": no endpoint), else one
    line naming the key: `hsx check` reports it, `hsx run` refuses to start with it (a
    second run on one machine must not die of the first one's port after its start-up)."""
    if not listen:
        return ""
    host, port = listen_address(listen)
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
                probe.bind(address)
    except OSError as exc:
        return bind_failure(listen, exc)
    return ""


def bind_failure(listen: str, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"daemon.metrics_listen {listen} is in use (another hsx run on this machine?): "
            'give each run its own HOST:PORT, or "" for no /metrics and /status'
        )
    return (
        f"daemon.metrics_listen {listen} cannot be bound: {exc.strerror or exc}; "
        'give a local HOST:PORT, or "" for no /metrics and /status'
    )
