"""The client's HTTP side: one request per attempt to a server of the pool (to its
engine's path: ``POST /generate`` to SGLang, ``POST /v1/completions`` to vLLM,
:mod:`hsx_async.engines`), every body read up to a bound; :func:`connected` opens the one
session a job uses.
"""

from __future__ import annotations

import contextlib
import functools
import urllib.parse
import zlib
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
import numpy.typing as npt
import orjson
import structlog
import yarl

from hsx_async.config import redact_url
from hsx_async.errors import DumpError, RequestError, ResponseError
from hsx_async.protocol import BF16_STORAGE, Storage
from hsx_async.run.servers.pool import Server, ServerPool

log = structlog.get_logger("hsx.client")

_BODY_EXCERPT = 300
# Every response body is read up to a bound, and inflated (gzip, deflate) only up to it: a
# prefill-only reply is a few KB, /health a few bytes, the info calls some KB. A body past
# the bound fails that call with a reason; nothing larger is ever held in memory.
MAX_BODY = 1 << 20
_READ_PIECE = 64 << 10
_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "gzip, deflate"}
_GET_HEADERS = {"Accept-Encoding": "gzip, deflate"}
# zlib window bits: 16 + 15 gzip only, 15 zlib, -15 raw deflate (some servers send that).
_WBITS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


class EngineClient:
    """HTTP calls to one or more servers (SGLang or vLLM), over one pooled session."""

    def __init__(self, session: aiohttp.ClientSession, pool: ServerPool) -> None:
        self.session = session
        self.pool = pool

    async def generate(
        self,
        server: Server,
        *,
        rid: str,
        ns: str,
        input_ids: npt.NDArray[np.int64],
        timeout: float,
        storage: Storage = BF16_STORAGE,
    ) -> None:
        """One prefill request, asking the hook to store the rows as ``storage``; raises
        RequestError or DumpError (bad response)."""
        engine = server.engine
        body = engine.build_body(rid, ns, input_ids, storage)
        parsed = await self.post_generate(server, body, timeout)
        try:
            engine.check(parsed, rid, int(input_ids.shape[0]))
        except ResponseError:
            raise
        except DumpError as exc:
            raise ResponseError(f"{server.display}: {exc}") from None

    async def post_generate(self, server: Server, request: object, timeout: float) -> object:
        """POST a body to the server's prefill endpoint; the parsed JSON answer, or
        RequestError."""
        return await self._post(server, server.generate_url, request, timeout)

    async def post_decode(self, server: Server, request: object, timeout: float) -> object:
        """POST a body to the server's decode endpoint (``hsx regenerate``); the parsed
        JSON answer, or RequestError."""
        return await self._post(server, server.decode_url, request, timeout)

    async def _post(self, server: Server, url: yarl.URL, request: object, timeout: float) -> object:
        body = orjson.dumps(request, option=orjson.OPT_SERIALIZE_NUMPY)
        try:
            async with self.session.post(
                url,
                data=body,
                headers=_HEADERS,
                timeout=_timeout(timeout),
                auto_decompress=False,
            ) as resp:
                payload = await read_body(resp, server.display)
                status = resp.status
        except TimeoutError:
            raise RequestError(
                f"{server.display}: no response within {timeout:g} s (server.request_timeout)",
                timed_out=True,
            ) from None
        except aiohttp.ClientError as exc:
            raise RequestError(
                f"{server.display}: {type(exc).__name__}: {_redact_text(str(exc), server.url)}",
                hard=True,
                # A refused or unresolvable connection: the request never left.
                reached=not isinstance(exc, aiohttp.ClientConnectorError),
            ) from None
        _raise_for_status(server.display, status, payload)
        try:
            parsed: object = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise RequestError(
                f"{server.display}: 200 with a body that is not JSON", server_fault=False
            ) from None
        return parsed

    async def health(self, url: str, timeout: float = 5.0) -> str:
        """'' when ``GET /health`` answers 200, else why not."""
        try:
            async with self.session.get(
                f"{url}/health",
                headers=_GET_HEADERS,
                timeout=aiohttp.ClientTimeout(total=timeout),
                auto_decompress=False,
            ) as resp:
                await read_body(resp, redact_url(url))
                return "" if resp.status == 200 else f"/health answered {resp.status}"
        except RequestError as exc:
            return str(exc)
        except (aiohttp.ClientError, TimeoutError) as exc:
            text = _redact_text(str(exc), url)
            return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

    async def get_json(self, url: str, path: str, timeout: float = 10.0) -> object:
        async with self.session.get(
            f"{url}{path}",
            headers=_GET_HEADERS,
            timeout=aiohttp.ClientTimeout(total=timeout),
            auto_decompress=False,
        ) as resp:
            payload = await read_body(resp, redact_url(url))
            _raise_for_status(redact_url(url), resp.status, payload)
            return orjson.loads(payload)


async def read_body(resp: aiohttp.ClientResponse, where: str, limit: int = MAX_BODY) -> bytes:
    """The response body, at most ``limit`` bytes once decoded; a longer one (announced,
    sent or inflated) is a :class:`RequestError` and is never read further. The response
    must have been requested with ``auto_decompress=False``: the inflating happens here,
    ``limit + 1`` bytes at most."""
    encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
    wbits = _WBITS.get(encoding)
    if wbits is None and encoding not in ("", "identity"):
        raise RequestError(f"{where}: response body has Content-Encoding {encoding!r}")
    if resp.content_length is not None and resp.content_length > limit:
        raise _too_large(where, f"announces {resp.content_length} bytes")
    inflate = None if wbits is None else zlib.decompressobj(wbits)
    body = bytearray()
    while piece := await resp.content.read(_READ_PIECE):
        if inflate is not None:
            try:
                piece = inflate.decompress(piece, limit + 1 - len(body))
            except zlib.error as exc:
                raise RequestError(f"{where}: response body is bad {encoding}: {exc}") from None
        body += piece
        if len(body) > limit:
            raise _too_large(where, "inflates" if inflate is not None else "runs")
    return bytes(body)


def _too_large(where: str, how: str) -> RequestError:
    return RequestError(f"{where}: response body {how} past {MAX_BODY} bytes; refused")


@functools.lru_cache(maxsize=8)
def _timeout(total: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total)


def _redact_text(text: str, url: str) -> str:
    """An exception's text with the URL's password masked, should aiohttp quote it."""
    password = urllib.parse.urlsplit(url).password
    return text.replace(password, "***") if password else text


def _raise_for_status(url: str, status: int, payload: bytes) -> None:
    if status == 200:
        return
    excerpt = payload[:_BODY_EXCERPT].decode("utf-8", "replace").strip()
    raise RequestError(
        f"{url}: HTTP {status}: {excerpt}", server_fault=status >= 500, status=status
    )


@contextlib.asynccontextmanager
async def connected(pool: ServerPool) -> AsyncIterator[EngineClient]:
    """One HTTP session to the pool's servers for the whole job."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as session:
        yield EngineClient(session, pool)
