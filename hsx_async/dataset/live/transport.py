"""A live reader's HTTP to ``hsx serve`` (PROTOCOL §6.4): one kept connection, the shared
secret on every request, TLS for ``https://``, retries, status codes and the download of a
sample file. Blocking (``http.client``: the reader runs in a trainer's process or its
DataLoader workers, which have no event loop).

Faults: a lost connection, a 5xx or a file that arrives torn is retried with backoff until
the server has been unreachable for ``unreachable_timeout`` seconds, then
:class:`~hsx_async.errors.LiveError`. A 4xx is the request's fault: raised at once; so are
a 401 (the secret: a :class:`LiveError` naming what to set) and a server certificate the
reader does not trust.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import ssl
import time
import urllib.parse
import weakref
from pathlib import Path
from typing import Any

import orjson
import xxhash

from hsx_async.dataset.live.ledger import LeaseLost, OwnerVoid
from hsx_async.dataset.live.secret import CA_FILE_ENV, SECRET_FILE_ENV, ca_file, read_secret
from hsx_async.dataset.live.wire import GONE, MAX_RESPONSE, VOID_STATUS
from hsx_async.errors import DatasetError, LiveError

UNREACHABLE_S = 600.0
REQUEST_S = 60.0  # one call (a lease's long poll is at most MAX_WAIT_S of it)


class Retry(Exception):
    """A fault worth another try (connection, 5xx, a torn file)."""


class Transport:
    """HTTP to one ``hsx serve``: ``url`` (``http://`` or ``https://``), the secret from
    ``secret_file`` (default: the environment, :func:`~.secret.read_secret`), the CA from
    ``ca_file`` (default ``HSX_SERVE_CA_FILE``, else the system's store)."""

    def __init__(
        self,
        url: str,
        *,
        secret_file: str | Path | None = None,
        ca_file: str | Path | None = None,
        unreachable_timeout: float = UNREACHABLE_S,
        request_timeout: float = REQUEST_S,
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise DatasetError(f"{url!r} is not an http(s)://HOST:PORT of hsx serve")
        self.url = url.rstrip("/")
        self._parts = parts
        self.unreachable_timeout = unreachable_timeout
        self.request_timeout = request_timeout
        secret = read_secret(secret_file, name="secret_file")
        self._headers = {} if secret is None else {"Authorization": f"Bearer {secret.decode()}"}
        self._tls = _client_context(ca_file) if parts.scheme == "https" else None
        self._held: list[http.client.HTTPConnection] = []  # the open connection, if any
        weakref.finalize(self, _close_all, self._held)

    def _connection(self) -> http.client.HTTPConnection:
        if not self._held:
            host, port = self._parts.hostname or "", self._parts.port
            if self._tls is None:
                conn = http.client.HTTPConnection(host, port, timeout=self.request_timeout)
            else:
                conn = http.client.HTTPSConnection(
                    host, port, timeout=self.request_timeout, context=self._tls
                )
            self._held.append(conn)
        return self._held[0]

    def drop(self) -> None:
        """Close the connection (the next call opens another)."""
        _close_all(self._held)

    def retrying(self, what: str, attempt: Any, *, patience: float | None = None) -> Any:
        """``attempt()`` until it succeeds, a 4xx, or ``patience`` (default
        ``unreachable_timeout``) seconds of faults."""
        patience = self.unreachable_timeout if patience is None else patience
        deadline = time.monotonic() + patience
        pause, last = 0.05, ""
        while True:
            try:
                return attempt()
            except ssl.SSLCertVerificationError as exc:
                self.drop()
                raise LiveError(
                    f"{self.url}: the server's certificate is not trusted ({exc.verify_message}"
                    f"): give ca_file= (or {CA_FILE_ENV}) the CA that signed hsx serve's "
                    "--tls-cert"
                ) from None
            except (Retry, OSError, http.client.HTTPException) as exc:
                self.drop()
                last = str(exc) or type(exc).__name__
                if isinstance(exc, ssl.SSLError) and exc.reason == "WRONG_VERSION_NUMBER":
                    raise LiveError(
                        f"{self.url}: the server does not speak TLS; give its http:// URL"
                    ) from None
            if time.monotonic() + pause > deadline:
                raise LiveError(
                    f"{self.url}: {what} failed for {patience:.0f} s (last: {last}); is hsx "
                    "serve running there?"
                )
            time.sleep(pause)  # backoff before another try of a remote call
            pause = min(pause * 2, 5.0)

    def json(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        patience: float | None = None,
    ) -> Any:
        """One call whose answer is JSON (retried as :meth:`retrying` says)."""
        data = None if body is None else orjson.dumps(body)

        def attempt() -> Any:
            conn = self._connection()
            headers = dict(self._headers)
            if data is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read(MAX_RESPONSE + 1)
            if len(raw) > MAX_RESPONSE:
                raise DatasetError(f"{self.url}{path}: answer over {MAX_RESPONSE} bytes")
            self._check_status(path, response.status, raw)
            return orjson.loads(raw)

        return self.retrying(f"{method} {path}", attempt, patience=patience)

    def _check_status(self, path: str, status: int, raw: bytes) -> None:
        if status >= 500:
            raise Retry(f"HTTP {status}")
        if status == 401:
            sent = "a secret hsx serve does not hold" if self._headers else "no secret"
            raise LiveError(
                f"{self.url} refused this reader (HTTP 401: it sent {sent}): set "
                f"{SECRET_FILE_ENV} (or secret_file=) to a file holding hsx serve's secret"
            )
        if status >= 400:
            try:
                message = orjson.loads(raw).get("error", "")
            except (orjson.JSONDecodeError, AttributeError):
                message = raw[:200].decode("utf-8", "replace")
            error = {GONE: LeaseLost, VOID_STATUS: OwnerVoid}.get(status, DatasetError)
            raise error(f"{self.url}{path}: {message} (HTTP {status})")

    def download(self, path: str, name: str, size: int, target: Path, view: memoryview) -> str:
        """One GET of ``path`` (a sample file of ``size`` bytes, ``name`` in messages)
        into ``target``, hashed on the way through ``view`` (one pass, one reused buffer);
        its XXH3-64. A short or over-long answer is retried (:class:`Retry`)."""
        conn = self._connection()
        conn.request("GET", path, headers=self._headers)
        response = conn.getresponse()
        if response.status != 200:
            self._check_status(path, response.status, response.read(64 << 10))
            raise Retry(f"HTTP {response.status}")
        length = int(response.getheader("Content-Length") or -1)
        if length != size:
            response.close()
            raise Retry(f"{name}: {length} bytes announced, {size} expected")
        hasher = xxhash.xxh3_64()
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            left = length
            while left:
                n = response.readinto(view[: min(len(view), left)])
                if not n:
                    raise Retry(f"{name}: cut after {length - left} of {length} bytes")
                hasher.update(view[:n])
                _write_all(fd, view[:n])
                left -= n
        finally:
            os.close(fd)
        return str(hasher.hexdigest())


def _client_context(ca: str | Path | None) -> ssl.SSLContext:
    """Verifies the server against ``ca`` (or ``HSX_SERVE_CA_FILE``, else the system's
    store)."""
    path = ca_file(ca)
    try:
        return ssl.create_default_context(cafile=None if path is None else str(path))
    except (OSError, ssl.SSLError) as exc:
        raise DatasetError(
            f"CA file {path}: {getattr(exc, 'strerror', None) or exc}; give ca_file= (or "
            f"{CA_FILE_ENV}) the PEM of the CA that signed hsx serve's certificate"
        ) from None


def _close_all(held: list[http.client.HTTPConnection]) -> None:
    while held:
        with contextlib.suppress(OSError):
            held.pop().close()


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]
