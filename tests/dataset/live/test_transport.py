"""The reader's HTTP to ``hsx serve`` (its secret, TLS, status codes) against a server it
cannot use: raised at once, naming what to change, never retried until the unreachable
timeout. The round trips with a real serve: tests/dataset/live/test_http.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from hsx_async.dataset.live.transport import Transport
from hsx_async.errors import DatasetError, LiveError


@pytest.fixture
def plain_port() -> Iterator[int]:
    """A plain-TCP server on 127.0.0.1 that answers any request with 401."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    done = threading.Event()

    def answer() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 2\r\n\r\n{}")

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        done.set()
        thread.join(10)
        server.close()


def test_https_to_a_plain_server_is_told_at_once(plain_port: int) -> None:
    transport = Transport(f"https://127.0.0.1:{plain_port}", unreachable_timeout=600)
    started = time.monotonic()
    with pytest.raises(LiveError, match="does not speak TLS; give its http:// URL"):
        transport.json("GET", "/v1/info")
    assert time.monotonic() - started < 30


def test_a_401_names_the_secret_to_set(plain_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HSX_SERVE_SECRET_FILE", raising=False)
    monkeypatch.setenv("HSX_SERVE_SECRET", "s" * 20)
    transport = Transport(f"http://127.0.0.1:{plain_port}", unreachable_timeout=600)
    with pytest.raises(LiveError, match=r"a secret hsx serve does not hold.*HSX_SERVE_SECRET_FILE"):
        transport.json("GET", "/v1/info")


def test_a_missing_ca_file_or_a_url_of_another_scheme_is_refused() -> None:
    with pytest.raises(DatasetError, match=r"CA file .*nope\.pem.*ca_file="):
        Transport("https://127.0.0.1:1", ca_file="/nonexistent/nope.pem")
    with pytest.raises(DatasetError, match="not an http"):
        Transport("ftp://127.0.0.1:1")
