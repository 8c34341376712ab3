"""A model of PyTorch's caching host allocator (``ATen/core/CachingHostAllocator.h``) as
the hook meets it, for the page-locked warm-up's tests (issue 40), and an ``async_d2h``
that takes its host buffers from it, as SGLang's does from the real one."""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from hsx_async.server.pinned import size_class


class CachingHostAllocator:
    """PyTorch's caching host allocator as the hook meets it: a request is rounded up to a
    power of two and served from that class's free list, else a new block is page-locked
    ("grown"); a block goes back to its class's list once nothing views its memory."""

    def __init__(self) -> None:
        self.free: Counter[int] = Counter()
        self.grown: list[int] = []
        self.live = 0
        self.peak_live = 0
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> np.ndarray:
        size = size_class(nbytes)
        with self._lock:
            if self.free[size]:
                self.free[size] -= 1
            else:
                self.grown.append(size)
            self.live += 1
            self.peak_live = max(self.peak_live, self.live)
        block = np.empty(size, dtype=np.uint8)
        weakref.finalize(block, self._release, size)
        return block

    def _release(self, size: int) -> None:
        with self._lock:
            self.free[size] += 1
            self.live -= 1


def pinned_d2h(allocator: CachingHostAllocator) -> Callable[[torch.Tensor], torch.Tensor]:
    """SGLang's ``async_d2h`` on CPU tensors: a host buffer from ``allocator`` (held while
    any view of it lives: the writers' rows, the logits output), the rows copied in."""

    def d2h(tensor: torch.Tensor) -> torch.Tensor:
        block = allocator.allocate(tensor.nbytes)
        host = torch.frombuffer(block, dtype=torch.uint8, count=tensor.nbytes)
        out = host.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    return d2h
