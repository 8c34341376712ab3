"""The page-locked warm-up's plan and loop (issue 40), without a GPU: the size classes a
pass of the configured shape takes, how many of each the budget admits, and that the
warm-up leaves them where PyTorch's caching host allocator finds them (modelled in
tests/server/host_allocator.py).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator

import pytest

from hsx_async.server.pinned import (
    IN_FLIGHT_PASSES,
    PassShape,
    WarmPlan,
    describe,
    plan_warmup,
    size_class,
    warm,
)
from tests.server.host_allocator import CachingHostAllocator

GIB = 1 << 30
# Kimi-K2.5's pass as the H200 run had it (issue 40): 16,384 rows, H 7168, 3 aux layers.
KIMI = {"rows": 16384, "hidden_size": 7168, "aux_layers": 3}


def shape(**over: object) -> PassShape:
    fields: dict[str, object] = {**KIMI, "model_bytes": 2, "device_stack": True, **over}
    return PassShape(**fields)  # type: ignore[arg-type]


def test_size_class_is_pytorchs_power_of_two_rounding() -> None:
    assert [size_class(n) for n in (1, 2, 3, 4, 5, 4096, 4097)] == [1, 2, 4, 4, 8, 4096, 8192]
    assert size_class(0) == 0
    for n in (939_524_096, 704_643_072, 234_881_024, 1_409_286_144):
        c = size_class(n)
        assert c >= n > c // 2 and c & (c - 1) == 0


@pytest.mark.parametrize(
    ("over", "copies"),
    [
        # The device stack: one bfloat16 [T, K+1, H] buffer.
        ({"device_stack": True}, [16384 * 4 * 7168 * 2]),
        # The plain path: SGLang's aux copy in the model's dtype, the hook's bf16 final.
        ({"device_stack": False}, [16384 * 3 * 7168 * 2, 16384 * 7168 * 2]),
        ({"device_stack": False, "model_bytes": 4}, [16384 * 3 * 7168 * 4, 16384 * 7168 * 2]),
    ],
    ids=["stack", "plain-bf16", "plain-fp32"],
)
def test_plan_covers_every_copy_of_a_pass_for_every_pass_held(
    over: dict[str, object], copies: list[int]
) -> None:
    s = shape(**over)
    assert list(s.copies()) == copies and s.nbytes == sum(copies)
    budget = 4 * GIB
    plan = plan_warmup(s, budget, background=True)
    assert plan.passes == budget // s.nbytes + IN_FLIGHT_PASSES
    want = Counter({size_class(n): 0 for n in copies})
    for n in copies:
        want[size_class(n)] += plan.passes
    assert Counter(plan.blocks) == want
    assert list(plan.blocks) == sorted(plan.blocks, reverse=True)


def test_kimi_stack_plan_is_six_one_gib_blocks() -> None:
    """0.94 GB passes into a 4 GiB queue: four queued, two in flight, each a 1 GiB block."""
    plan = plan_warmup(shape(), 4 * GIB, background=True)
    assert plan.blocks == (GIB,) * 6 and plan.nbytes == 6 * GIB


@pytest.mark.parametrize("budget_passes", [0.5, 1, 1.5, 3, 7.99])
def test_the_queued_passes_are_capped_by_the_budget(budget_passes: float) -> None:
    s = shape()
    budget = int(budget_passes * s.nbytes)
    plan = plan_warmup(s, budget, background=True)
    queued = plan.passes - IN_FLIGHT_PASSES
    # What the writers may hold: within the budget, or one pass let through alone.
    assert queued * s.nbytes <= max(budget, s.nbytes)
    assert (queued + 1) * s.nbytes > budget  # and no fewer than the budget admits


def test_without_background_writers_only_the_passes_in_flight() -> None:
    plan = plan_warmup(shape(), 4 * GIB, background=False)
    assert plan.passes == IN_FLIGHT_PASSES and plan.blocks == (GIB,) * IN_FLIGHT_PASSES


def test_no_rows_no_plan() -> None:
    plan = plan_warmup(shape(rows=0), 4 * GIB, background=True)
    assert plan == WarmPlan((), 0) and plan.nbytes == 0


def small_shape() -> PassShape:
    return PassShape(rows=64, hidden_size=32, aux_layers=3, model_bytes=2, device_stack=False)


def test_warm_holds_every_block_at_once_then_frees_them_into_the_cache() -> None:
    s = small_shape()
    plan = plan_warmup(s, 3 * s.nbytes, background=True)
    allocator = CachingHostAllocator()
    ticks: Iterator[float] = iter([10.0, 12.5])
    result = warm(plan, allocator.allocate, clock=lambda: next(ticks))
    assert (result.blocks, result.nbytes, result.seconds, result.error) == (
        len(plan.blocks),
        plan.nbytes,
        2.5,
        "",
    )
    assert allocator.peak_live == len(plan.blocks) and allocator.live == 0
    assert allocator.free == Counter(plan.blocks)
    # Passes of the shape, as many at once as the plan holds, now grow nothing.
    held = [allocator.allocate(n) for _ in range(plan.passes) for n in s.copies()]
    assert allocator.grown == sorted(plan.blocks, reverse=True)  # the warm-up's only
    del held


def test_without_the_warm_up_the_first_passes_grow_the_cache() -> None:
    """The failure the warm-up removes: every block the first passes hold is grown."""
    s = small_shape()
    allocator = CachingHostAllocator()
    held = [allocator.allocate(n) for _ in range(3) for n in s.copies()]
    assert len(allocator.grown) == len(held) == 6
    del held


def test_running_out_of_page_locked_memory_keeps_what_was_made() -> None:
    plan = WarmPlan((GIB, GIB, GIB), 3)
    made: list[int] = []

    def allocate(nbytes: int) -> object:
        if len(made) == 2:
            raise RuntimeError("CUDA error: out of memory\nmore detail")
        made.append(nbytes)
        return object()

    result = warm(plan, allocate)
    assert (result.blocks, result.nbytes) == (2, 2 * GIB)
    assert result.error == "CUDA error: out of memory"
    assert result.seconds >= 0


def test_describe_says_the_cost_and_the_shape() -> None:
    s = shape()
    plan = plan_warmup(s, 4 * GIB, background=True)
    ticks = iter([0.0, 1.25])
    result = warm(plan, lambda n: object(), clock=lambda: next(ticks))
    text = describe(s, plan, result, 4 * GIB)
    assert "6 blocks (6 × 1 GiB), 6.44 GB in 1.25 s" in text
    assert "6 passes of 16384 rows (H 7168, 3 aux layers" in text
    assert "device stack path, writers' budget 4096 MiB" in text
    stopped = describe(s, plan, dataclasses.replace(result, blocks=2, error="oom"), 4 * GIB)
    assert stopped.endswith("stopped after 2 of 6: oom")
