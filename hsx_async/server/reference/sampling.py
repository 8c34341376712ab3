"""The reference server's sampler: temperature and nucleus (top-p) sampling, seeded per
request, so that a request with ``sampling_seed`` gets the same tokens however it is
batched (each request draws from its own generator, in its own order).

Imports torch; :mod:`.server` imports it only for a sampled (non-greedy) request.
"""

from __future__ import annotations

import torch

from hsx_async.server.front import Sampling


class TokenPicker:
    """Picks one request's next tokens from its logits, one call per decode step."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self._gen = torch.Generator()
        if sampling.seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(sampling.seed % (1 << 64))

    def __call__(self, logits: torch.Tensor) -> int:
        """``logits``: float [vocab]. Greedy at temperature 0."""
        if self.sampling.greedy:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / self.sampling.temperature, dim=-1)
        if self.sampling.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            before = sorted_probs.cumsum(0) - sorted_probs
            sorted_probs[before >= self.sampling.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._gen))
