"""Network addresses: the rule of every ``HOST:PORT`` listen setting (``--listen``,
``[daemon].metrics_listen``), one place for the run, ``hsx serve`` and the config."""

from __future__ import annotations

import ipaddress


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
