"""Page-locked host memory made ready before the hook's first pass (issue 40). Pure: the
plan and the warm-up loop; the allocator is the caller's (the SGLang glue passes torch's).

Every copy of a pass to the host (SGLang's ``async_d2h``) takes a fresh
``torch.empty(..., pin_memory=True)``. PyTorch's caching host allocator rounds each request
up to a power of two (its default; ``pinned_max_round_threshold`` unset) and serves it from
a free list of exactly that size class, or else page-locks a new block. Freed blocks go
back to their class's free list, never to the system. So after a start the first passes
grow the cache until it holds what the writers hold (up to the queue's budget), each
growth a fresh page-locked allocation on the scheduler thread: on an H200, 80–190 ms a
call, 113–198 ms of scheduler CPU per GB for the first ~10 passes (issue 40; the steady
state costs 9–24).

The warm-up allocates, once, every block the passes will hold at the same time (the
passes queued for the writers, plus the ones the scheduler thread holds) in the size
classes a pass of the configured shape takes, all at once so that each is a distinct
block, then frees them: they stay in the allocator's free lists, where the passes'
copies find them. Passes of fewer rows fall into smaller classes and still grow those,
once (smaller, so cheaper: the cost is per byte locked).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

BF16_BYTES = 2
# Passes whose host buffers are alive besides those the writers queue: the one whose
# result the scheduler thread is handing over (it waits there while the queue is full) and
# the one whose copy is in flight behind the forward (SGLang's overlap scheduling).
IN_FLIGHT_PASSES = 2


@dataclass(frozen=True, slots=True)
class PassShape:
    """The largest pass the hook copies: ``rows`` rows of ``aux_layers`` aux layers and the
    final state, ``hidden_size`` wide, the model's values ``model_bytes`` each; copied as
    one ``[T, L, H]`` bfloat16 stack (``device_stack``) or as SGLang's aux copy (the
    model's dtype) plus the hook's bfloat16 copy of the final state."""

    rows: int
    hidden_size: int
    aux_layers: int
    model_bytes: int
    device_stack: bool

    def copies(self) -> tuple[int, ...]:
        """Bytes of each host buffer one pass's copies allocate."""
        t, h, k = self.rows, self.hidden_size, self.aux_layers
        if self.device_stack:
            return (t * (k + 1) * h * BF16_BYTES,)
        return (t * k * h * self.model_bytes, t * h * BF16_BYTES)

    @property
    def nbytes(self) -> int:
        """Host bytes one pass holds (what the writers' budget counts for it)."""
        return sum(self.copies())


def size_class(nbytes: int) -> int:
    """The block PyTorch's caching host allocator serves ``nbytes`` from: the next power
    of two (``c10::llvm::PowerOf2Ceil``)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


@dataclass(frozen=True, slots=True)
class WarmPlan:
    """The blocks to make ready, largest first, and how many passes they hold."""

    blocks: tuple[int, ...]
    passes: int

    @property
    def nbytes(self) -> int:
        return sum(self.blocks)


def plan_warmup(shape: PassShape, queue_bytes: int, *, background: bool) -> WarmPlan:
    """The blocks that passes of ``shape`` hold at once: as many passes as the writers'
    budget ``queue_bytes`` admits (at least one: a pass larger than the budget is let
    through alone), none without background writers (each pass is written before the
    next is handed over), plus :data:`IN_FLIGHT_PASSES`."""
    copies = [n for n in shape.copies() if n > 0]
    if not copies:
        return WarmPlan((), 0)
    queued = max(1, queue_bytes // shape.nbytes) if background else 0
    passes = queued + IN_FLIGHT_PASSES
    blocks = sorted((size_class(n) for n in copies for _ in range(passes)), reverse=True)
    return WarmPlan(tuple(blocks), passes)


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What a warm-up made ready, and what it cost; ``error``: why it stopped early."""

    blocks: int
    nbytes: int
    seconds: float
    error: str = ""


def warm(
    plan: WarmPlan,
    allocate: Callable[[int], object],
    clock: Callable[[], float] = time.perf_counter,
) -> WarmResult:
    """Allocate every block of ``plan`` (all held at once: distinct blocks), then free
    them into the allocator's cache. Running out of page-locked memory stops the warm-up,
    not the server: what was made ready stays, the rest grows as before."""
    held: list[object] = []
    error = ""
    started = clock()
    try:
        for size in plan.blocks:
            held.append(allocate(size))
    except (RuntimeError, MemoryError) as exc:  # cudaHostAlloc failed: torch raises these
        error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    made = len(held)
    held.clear()  # back to the allocator's free lists
    return WarmResult(made, sum(plan.blocks[:made]), clock() - started, error)


def describe(shape: PassShape, plan: WarmPlan, result: WarmResult, queue_bytes: int) -> str:
    """The start-up log line: what was made ready, for which passes, at what cost."""
    classes = sorted(set(plan.blocks), reverse=True)
    counts = ", ".join(f"{plan.blocks.count(c)} × {_size(c)}" for c in classes)
    path = "device stack" if shape.device_stack else "plain"
    text = (
        f"page-locked host memory made ready before the first pass: {result.blocks} blocks "
        f"({counts}), {result.nbytes / 1e9:.2f} GB in {result.seconds:.2f} s, for "
        f"{plan.passes} passes of {shape.rows} rows (H {shape.hidden_size}, "
        f"{shape.aux_layers} aux layers + the final state, {path} path, writers' budget "
        f"{queue_bytes >> 20} MiB)"
    )
    if result.error:
        text += f"; stopped after {result.blocks} of {len(plan.blocks)}: {result.error}"
    return text


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"
