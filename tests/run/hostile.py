"""A hostile SGLang stand-in for issue 15: it speaks just enough of PROTOCOL §2–3 (valid
dumps of zero rows, or not), and misbehaves the way a probe did — a ``meta.json`` that is
a FIFO, a gzip body that inflates far past any reply, booleans for token counts. Served
in the test's own event loop on 127.0.0.1, an ephemeral port; no engine can be made to
misbehave like this on purpose, so this minimal stand-in is what the tests use."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from hsx_async.protocol import CUSTOM_PARAM_NS, DumpMeta, part_name, row_bytes

H = 64
AUX = (1, 3, 5)
# A gzip body far past the client's 1 MiB bound, itself small on the wire.
BOMB_BYTES = 64 << 20


@dataclass
class Hostile:
    root: Path
    mode: str = "normal"
    gate: asyncio.Event | None = None  # when set: every /generate waits for it
    health_mode: str = "normal"
    requests: list[str] = field(default_factory=list)
    seen: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""


def _dump(h: Hostile, ns: str, rid: str, n: int) -> None:
    d = h.root / ns / rid
    d.mkdir()
    (d / part_name(0, n)).write_bytes(bytes(n * row_bytes(H, AUX)))
    meta = DumpMeta(
        rid=rid, num_tokens=n, hidden_size=H, aux_layers=AUX, parts=((0, n),),
        model="hostile", server="hostile",
    )  # fmt: skip
    if h.mode == "fifo_meta":
        os.mkfifo(d / "meta.json")
    else:
        (d / "meta.json").write_bytes(meta.to_json())


@functools.lru_cache(maxsize=2)
def gzip_bomb(reply: bytes) -> bytes:
    """``reply`` with BOMB_BYTES of JSON whitespace before its closing brace, gzipped."""
    z = zlib.compressobj(1, wbits=31)
    out = [z.compress(reply[:-1])]
    pad = b" " * (1 << 20)
    out.extend(z.compress(pad) for _ in range(BOMB_BYTES >> 20))
    out.append(z.compress(reply[-1:]))
    out.append(z.flush())
    return b"".join(out)


def _reply(h: Hostile, rid: str, n: int) -> web.Response:
    meta: dict[str, Any] = {"id": rid, "prompt_tokens": n, "cached_tokens": 0}
    if h.mode == "cached_false":
        meta["cached_tokens"] = False
    if h.mode == "prompt_true":
        meta["prompt_tokens"] = True
    body = orjson.dumps({"text": "", "meta_info": meta})
    if h.mode == "gzip_bomb":
        return web.Response(
            body=gzip_bomb(body),
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
    if h.mode == "huge_body":
        return web.Response(body=body[:-1] + b" " * (2 << 20) + b"}")
    return web.Response(body=body, content_type="application/json")


def build_app(h: Hostile) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        rid = body["rid"]
        ns = body["sampling_params"]["custom_params"][CUSTOM_PARAM_NS]
        n = len(body["input_ids"])
        h.requests.append(rid)
        h.seen.set()
        if h.gate is not None:
            await h.gate.wait()
        _dump(h, ns, rid, n)
        return _reply(h, rid, n)

    async def health(request: web.Request) -> web.Response:
        if h.health_mode == "gzip_bomb":
            return web.Response(body=gzip_bomb(b"{}"), headers={"Content-Encoding": "gzip"})
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    return app


@contextlib.asynccontextmanager
async def hostile_server(h: Hostile) -> AsyncIterator[Hostile]:
    runner = web.AppRunner(build_app(h))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    h.url = f"http://127.0.0.1:{int(runner.addresses[0][1])}"
    try:
        yield h
    finally:
        if h.gate is not None:
            h.gate.set()
        await runner.cleanup()


@contextlib.contextmanager
def mounted_tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``where`` for one test, unmounted after. Needs root: elsewhere
    the test is skipped, except under CI (``CI`` set), where it fails."""
    import pytest

    where.mkdir(exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        why = f"cannot mount a tmpfs ({options}): {proc.stderr.strip() or proc.returncode}"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(f"{why}; run as root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)
