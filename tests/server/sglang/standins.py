"""Stand-ins for the SGLang 0.5.23 classes the hook patches (``Req``, the batch result
processor, ``GenerationBatchResult``, ``ModelRunner``) and a tiny CPU torch model whose
decoder stack captures aux layers the way SGLang's models do. Used by the glue's tests and
by ``bench/hook.py``, which drives the real glue through them at Kimi-K2.5's shape.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from hsx_async.server.sglang.hook import SglangApi

NS = "w0"
H = 8
N_LAYERS = 6
SGLANG_DEFAULT_LAYERS = [3, 4]  # what SGLang's set_eagle3_layers_to_capture left behind
LAYERS = (1, 4)
NULL, FULL = "NULL", "FULL"


# --------------------------------------------------------------------------------------
# Stand-ins
# --------------------------------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.scale = float(index + 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x * self.scale) / self.scale


def final_norm(x: torch.Tensor) -> torch.Tensor:
    return x / (x.pow(2).mean(-1, keepdim=True) + 1.0).sqrt()


class Stack(nn.Module):
    """A decoder stack that captures "before layer i", by list or by per-layer flag."""

    def __init__(self, *, flag_based: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(i) for i in range(N_LAYERS))
        self.layers_to_capture = list(SGLANG_DEFAULT_LAYERS)
        self.flag_based = flag_based
        if flag_based:
            for i in SGLANG_DEFAULT_LAYERS:
                layer: Any = self.layers[i]
                layer._is_layer_to_capture = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        aux = []
        for i, layer in enumerate(self.layers):
            if self._captures(i, layer):
                aux.append(x)
            x = layer(x)
        return final_norm(x), torch.cat(aux, dim=-1)

    def _captures(self, i: int, layer: nn.Module) -> bool:
        if self.flag_based:
            return bool(getattr(layer, "_is_layer_to_capture", False))
        return i in self.layers_to_capture


class CausalLM(nn.Module):
    def __init__(self, *, flag_based: bool = False) -> None:
        super().__init__()
        self.model = Stack(flag_based=flag_based)


def reference_rows(x: torch.Tensor) -> np.ndarray:
    """HF-style: hidden_states[k] for k in LAYERS, then the final norm; [T, L, H] bf16 bits."""
    states = [x]
    stack = Stack()
    for layer in stack.layers:
        states.append(layer(states[-1]))
    picked = [states[k] for k in LAYERS] + [final_norm(states[-1])]
    rows = torch.stack(picked, dim=1).to(torch.bfloat16)
    return rows.view(torch.int16).numpy().view("<u2")


class Event:
    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def make_api(d2h_calls: list[torch.Tensor]) -> SglangApi:
    """Fresh stand-in classes per test, so patches never leak between tests."""

    class Req:
        def __init__(self, rid: object, origin_input_ids: list[int], sampling_params: Any) -> None:
            self.rid = rid
            self.origin_input_ids = origin_input_ids
            self.sampling_params = sampling_params
            self.return_hidden_states = False
            self.return_hidden_states_mode = NULL
            self.is_retracted = False
            self.inflight_middle_chunks = 0
            self.to_finish: object = None
            self.discard_output_reason: object = None
            self.finished_reason: object = None

        def finished(self) -> bool:
            return self.finished_reason is not None

    class Processor:
        def __init__(self) -> None:
            self.calls = 0

        def process_batch_result_prefill(self, batch: Any, result: Any) -> None:
            """What SGLang does after the hook: count chunks down, finish the rest."""
            self.calls += 1
            for req in batch.reqs:
                if req.inflight_middle_chunks > 0:
                    req.inflight_middle_chunks -= 1
                elif not req.is_retracted:
                    req.finished_reason = "length"

    class Result:
        def __init__(self, logits_output: Any, lens: list[int] | None) -> None:
            self.logits_output = logits_output
            self.extend_input_len_per_req = lens
            self.copy_done = Event()
            self.can_run_cuda_graph = False
            self.copies: list[bool] = []

        def copy_to_cpu(self, return_logprob: bool, return_hidden_states: bool = True) -> None:
            self.copies.append(return_hidden_states)

    class Runner:
        def __init__(self, model: nn.Module) -> None:
            self.model: Any = model

        def forward(self, batch: torch.Tensor | Any) -> tuple[torch.Tensor, torch.Tensor]:
            """``batch``: the rows, or a stand-in ForwardBatch (``input``, ``rids``)."""
            x = batch if isinstance(batch, torch.Tensor) else batch.input
            out: tuple[torch.Tensor, torch.Tensor] = self.model.model(x)
            return out

    return SglangApi(
        req_cls=Req,
        processor_cls=Processor,
        result_cls=Result,
        runner_cls=Runner,
        full_capture=FULL,
        async_d2h=RecordingD2h(d2h_calls),
    )


class RecordingD2h:
    """SGLang's ``async_d2h`` as the tests see it: each tensor it is given is recorded,
    and a copy returned."""

    def __init__(self, calls: list[torch.Tensor]) -> None:
        self.calls = calls

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.calls.append(t)
        return t.clone()


def params(ns: object | None = NS, max_new_tokens: int = 0, **extra: object) -> SimpleNamespace:
    """A request's sampling params; ``extra``: more custom_params (e.g. hsx_dtype)."""
    custom = None if ns is None else {"hsx_ns": ns, **extra}
    return SimpleNamespace(custom_params=custom, max_new_tokens=max_new_tokens)
