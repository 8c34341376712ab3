"""Test-only stand-in for the CUDA-only ``sgl_kernel`` wheel (see ../README.md).

Implements the one kernel SGLang 0.5.23's CPU path calls on a machine without AMX
(``assign_req_to_token_pool_cpu``) in torch; any other name imports but raises when called,
so a code path that would need a real kernel fails loudly instead of computing garbage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+hsx-test-standin"


def assign_req_to_token_pool_cpu(  # noqa: PLR0917 - SGLang passes all six positionally
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request r: ``req_to_token[req_pool_indices[r], start:end]`` = the next
    ``end - start`` entries of ``out_cache_loc`` (SGLang's Triton kernel, in torch)."""
    del pool_len
    taken = 0
    for pool, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        count = end - start
        req_to_token[pool, start:end] = out_cache_loc[taken : taken + count]
        taken += count


def _missing(name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name}: the hsx test stand-in has no such kernel (CPU torch only)"
        )

    kernel.__name__ = name
    return kernel


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
