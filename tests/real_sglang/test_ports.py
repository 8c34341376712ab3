"""The tier's server ports (no SGLang needed): below the kernel's ephemeral range, so no
connection on the machine takes one while a server starts, and free with the ports SGLang
derives from it under DP attention."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.real_sglang.conftest import DP_ATTENTION_PORT_OFFSETS, server_port


def test_server_port_is_below_the_ephemeral_range_and_free() -> None:
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    ephemeral_low = int(ranges.read_text().split()[0]) if ranges.is_file() else 32768
    for _ in range(5):
        port = server_port()
        assert port + max(DP_ATTENTION_PORT_OFFSETS) < min(ephemeral_low, 22000)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binding it works
