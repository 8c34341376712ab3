"""The /dev/shm byte budget: first come, first served, resizable, cancellation-safe.

Driven without sleeps: ``_settle`` yields to the loop until every runnable task has run.
"""

from __future__ import annotations

import asyncio

import pytest

from hsx_async.run.pipeline.budget import ByteBudget


async def _settle() -> None:
    """Let every task that can run, run (a few loop turns; no wall-clock wait)."""
    for _ in range(10):
        await asyncio.sleep(0)


def _waiter(budget: ByteBudget, n: int, order: list[int]) -> asyncio.Task[None]:
    async def run() -> None:
        await budget.acquire(n)
        order.append(n)

    return asyncio.create_task(run(), name=f"acquire-{n}")


async def test_acquire_and_release_without_contention() -> None:
    b = ByteBudget(100)
    await b.acquire(60)
    await b.acquire(40)
    assert (b.used, b.waiting, b.capacity) == (100, 0, 100)
    b.release(100)
    assert b.used == 0
    await b.acquire(0)
    assert b.used == 0


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity must be positive"):
        ByteBudget(capacity)
    with pytest.raises(ValueError, match="capacity must be positive"):
        ByteBudget(10).resize(capacity)


async def test_request_larger_than_the_budget_fails_at_once() -> None:
    b = ByteBudget(100)
    with pytest.raises(ValueError, match="101 bytes can never fit a budget of 100"):
        await b.acquire(101)
    assert (b.used, b.waiting) == (0, 0)


async def test_release_more_than_held_is_refused() -> None:
    b = ByteBudget(100)
    await b.acquire(10)
    with pytest.raises(ValueError, match="releasing 11 bytes but only 10 are held"):
        b.release(11)
    assert b.used == 10


async def test_negative_release_is_refused() -> None:
    b = ByteBudget(100)
    with pytest.raises(ValueError):
        b.release(-50)
    assert b.used == 0


async def test_waiters_are_served_in_arrival_order() -> None:
    b = ByteBudget(100)
    await b.acquire(100)
    order: list[int] = []
    tasks = [_waiter(b, n, order) for n in (70, 10, 20)]
    await _settle()
    assert (b.waiting, order) == (3, [])
    b.release(30)  # 70 does not fit yet; 10 would, but must not overtake it
    await _settle()
    assert (b.waiting, order, b.used) == (3, [], 70)
    b.release(70)  # now 70 and, behind it, 10 and 20 fit
    await _settle()
    assert order == [70, 10, 20]
    assert (b.used, b.waiting) == (100, 0)
    await asyncio.gather(*tasks)


async def test_newcomer_does_not_barge_past_a_waiter() -> None:
    b = ByteBudget(100)
    await b.acquire(50)
    order: list[int] = []
    big = _waiter(b, 80, order)
    await _settle()
    small = _waiter(b, 10, order)  # 50 + 10 fits, but the 80 came first
    await _settle()
    assert order == []
    b.release(50)
    await _settle()
    assert order == [80, 10]
    await asyncio.gather(big, small)


async def test_growing_wakes_waiters() -> None:
    b = ByteBudget(100)
    await b.acquire(100)
    order: list[int] = []
    task = _waiter(b, 50, order)
    await _settle()
    b.resize(150)
    await _settle()
    assert (order, b.used, b.capacity) == ([50], 150, 150)
    await task


async def test_shrinking_never_revokes_it_only_waits() -> None:
    b = ByteBudget(100)
    await b.acquire(80)
    b.resize(50)
    assert b.used == 80  # held bytes stay held
    order: list[int] = []
    task = _waiter(b, 10, order)
    await _settle()
    b.release(30)  # 50 held: full at the new size
    await _settle()
    assert order == []
    b.release(10)
    await _settle()
    assert (order, b.used) == ([10], 50)
    await task
    with pytest.raises(ValueError, match="never fit"):
        await b.acquire(60)


async def test_cancelled_head_waiter_lets_the_next_one_in() -> None:
    b = ByteBudget(100)
    await b.acquire(60)
    order: list[int] = []
    big = _waiter(b, 90, order)
    small = _waiter(b, 40, order)
    await _settle()
    assert b.waiting == 2
    big.cancel()
    await _settle()
    assert big.cancelled()
    assert (order, b.used, b.waiting) == ([40], 100, 0)
    await small


async def test_cancelled_middle_waiter_leaves_no_trace() -> None:
    b = ByteBudget(100)
    await b.acquire(100)
    order: list[int] = []
    tasks = [_waiter(b, n, order) for n in (30, 30, 30)]
    await _settle()
    tasks[1].cancel()
    await _settle()
    assert b.waiting == 2
    b.release(100)
    await _settle()
    assert (order, b.used, b.waiting) == ([30, 30], 60, 0)
    await asyncio.gather(tasks[0], tasks[2])


async def test_cancel_right_after_the_grant_gives_the_bytes_back() -> None:
    b = ByteBudget(100)
    await b.acquire(100)
    order: list[int] = []
    task = _waiter(b, 40, order)
    await _settle()
    b.release(100)  # grants the 40 to the waiter...
    task.cancel()  # ...which is cancelled before it ever runs again
    await _settle()
    assert task.cancelled()
    assert (order, b.used, b.waiting) == ([], 0, 0)


async def test_cancel_then_release_in_the_same_turn() -> None:
    b = ByteBudget(100)
    await b.acquire(100)
    order: list[int] = []
    task = _waiter(b, 40, order)
    await _settle()
    task.cancel()
    b.release(100)  # _wake() drops the cancelled future before the task sees it
    # gather retrieves the outcome, so a wrong exception fails here instead of being logged.
    (outcome,) = await asyncio.gather(task, return_exceptions=True)
    assert isinstance(outcome, asyncio.CancelledError), repr(outcome)
    assert (b.used, b.waiting) == (0, 0)


async def test_many_waiters_drain_in_order_and_account_exactly() -> None:
    b = ByteBudget(10)
    await b.acquire(10)
    order: list[int] = []
    sizes = [3, 7, 1, 9, 2, 5, 10, 4]
    tasks = [_waiter(b, n, order) for n in sizes]
    await _settle()
    held = 10
    for _ in sizes:
        b.release(held)
        await _settle()
        held = b.used
    assert order == sizes
    b.release(held)
    assert (b.used, b.waiting) == (0, 0)
    await asyncio.gather(*tasks)
