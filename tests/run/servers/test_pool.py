"""ServerPool: least loaded first with round-robin ties, eviction, retirement on reload,
and the unreachable timeout. No sockets: the pool is pure bookkeeping over asyncio."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import structlog.testing

from hsx_async.config import ServerConfig
from hsx_async.errors import NoServerError, RequestError
from hsx_async.run.servers.pool import SOFT_FAILURES_TO_EVICT, Server, ServerPool

URLS = ["http://a:1", "http://b:2", "http://c:3"]


def _pool(urls: list[str] = URLS, *, unreachable: float = 5.0) -> ServerPool:
    return ServerPool(urls, health_interval=0.01, unreachable_timeout=unreachable)


def _state(server: Server) -> tuple[bool, int, float | None]:
    """Read afresh (mypy would keep an attribute narrowed across the awaits)."""
    return server.healthy, server.soft_failures, server.down_since


@contextlib.asynccontextmanager
async def _held(pool: ServerPool, n: int) -> AsyncIterator[list[Server]]:
    """``n`` leases held at once, in the order the pool handed them out."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(pool.lease()) for _ in range(n)]


async def test_lease_prefers_the_least_loaded_server() -> None:
    pool = _pool()
    async with _held(pool, 3) as first:
        assert sorted(s.url for s in first) == URLS, "one each before any gets a second"
        assert all(s.in_flight == 1 for s in pool.servers)
    assert all(s.in_flight == 0 for s in pool.servers), "a lease gives its slot back"
    a = pool.servers[0]
    async with pool.lease() as busy:
        async with _held(pool, 2) as others:
            assert busy not in others
        assert a.requests >= 1


async def test_ties_rotate_instead_of_always_picking_the_first() -> None:
    pool = _pool()
    picked = []
    for _ in range(6):
        async with pool.lease() as server:
            picked.append(server.url)
    assert set(picked) == set(URLS)
    assert picked[:3] == picked[3:], "round robin over equally loaded servers"
    assert [s.requests for s in pool.servers] == [2, 2, 2]


async def test_a_hard_failure_evicts_at_once_and_restore_brings_it_back() -> None:
    pool = _pool()
    bad = pool.servers[1]
    await pool.failed(bad, RequestError("connection refused", hard=True))
    assert not bad.healthy and bad.down_since is not None
    assert bad.last_error == "connection refused"
    for _ in range(4):
        async with pool.lease() as server:
            assert server is not bad
    await pool.restore(bad)
    assert _state(bad) == (True, 0, None)


@pytest.mark.usefixtures("fresh_structlog")
async def test_a_first_admission_is_no_return_and_leaves_no_error() -> None:
    """Issue 39: a healthy server's first admission was logged as server_back_in_rotation
    and /status kept last_error "not checked yet" while it served."""
    pool = ServerPool(URLS, health_interval=0.01, unreachable_timeout=5.0, admission=True)
    new, again = pool.servers[0], pool.servers[1]
    assert new.last_error == "not checked yet" and not new.healthy
    await pool.restore(again)  # admitted, then out, then back
    await pool.failed(again, RequestError("connection refused", hard=True))
    with structlog.testing.capture_logs() as logs:
        await pool.restore(new)
        await pool.restore(again)
    # The admission logs server_admitted for both (hsx_async.run.servers.admission).
    assert [(e["event"], e["server"]) for e in logs] == [("server_back_in_rotation", again.display)]
    assert new.last_error == "" and again.last_error == "connection refused"


async def test_soft_failures_evict_only_when_consecutive() -> None:
    pool = _pool()
    server = pool.servers[0]
    for _ in range(SOFT_FAILURES_TO_EVICT - 1):
        await pool.failed(server, RequestError("HTTP 503"))
    pool.succeeded(server)  # the streak is broken
    for _ in range(SOFT_FAILURES_TO_EVICT - 1):
        await pool.failed(server, RequestError("HTTP 503"))
    assert server.healthy
    await pool.failed(server, RequestError("HTTP 503"))
    assert not server.healthy


async def test_a_client_side_error_never_counts_against_the_server() -> None:
    pool = _pool()
    server = pool.servers[0]
    for _ in range(SOFT_FAILURES_TO_EVICT + 2):
        await pool.failed(server, RequestError("HTTP 400: bad input", server_fault=False))
    assert server.healthy and server.soft_failures == 0
    assert server.last_error == "HTTP 400: bad input"


async def test_reload_retires_removed_servers_and_adds_new_ones() -> None:
    pool = _pool(URLS[:2])
    gone = pool.servers[1]
    async with pool.lease() as one, pool.lease() as two:
        assert {one, two} == set(pool.servers)
        await pool.apply(
            ServerConfig(urls=("http://a:1/", "http://d:4"), health_interval=2.0,
                         unreachable_timeout=9.0)
        )  # fmt: skip
        assert gone.retired and gone.in_flight == 1, "its request finishes"
    assert gone.in_flight == 0
    assert [s.url for s in pool.healthy()] == ["http://a:1", "http://d:4"]
    assert (pool.health_interval, pool.unreachable_timeout) == (2.0, 9.0)
    for _ in range(4):
        async with pool.lease() as server:
            assert server is not gone
    await pool.set_urls(URLS[:2])  # back in the config: back in rotation
    assert gone in pool.healthy(), "not retired any more"


async def test_waiting_for_a_server_ends_when_one_comes_back() -> None:
    pool = _pool(URLS[:1])
    only = pool.servers[0]
    await pool.evict(only, "down")
    waiter = asyncio.create_task(pool.wait_healthy())
    await asyncio.sleep(0)  # the waiter is parked on the pool's condition
    assert not waiter.done()
    await pool.restore(only)
    async with asyncio.timeout(5):
        await waiter


async def test_no_server_for_the_unreachable_timeout_is_a_clear_error() -> None:
    pool = _pool(URLS[:2], unreachable=0.05)
    for server in pool.servers:
        server.last_error = "ConnectionRefusedError"
        await pool.evict(server, "refused")
    with pytest.raises(NoServerError, match=r"no server answered for 0\.05 s") as err:
        async with pool.lease():
            pass
    text = str(err.value)
    assert "server.unreachable_timeout" in text and "[server].urls" in text
    assert "http://a:1: ConnectionRefusedError" in text
