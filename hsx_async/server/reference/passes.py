"""One pass of the reference server, run in a worker thread: the packed forward of the
scheduled slices, then the dumper every hook uses writes the hsx requests' parts and
commits (:class:`~hsx_async.server.sched.PassDumper` describes the slices to it as the
SGLang glue describes a prefill batch, so planning, chunk continuity, refusals and aborts
run the code that runs inside SGLang, on a real model's rows).

Imports torch (through :mod:`.model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from hsx_async.protocol import Storage
from hsx_async.quantize import encode_rows
from hsx_async.server.dumper import PrefillDumper
from hsx_async.server.hook_core import HookConfig, uniform_storage
from hsx_async.server.reference.model import PackedEngine, Segment, SegmentOutput
from hsx_async.server.rows import BatchHidden, EncodedPass, PassRows
from hsx_async.server.sched import Job, PassDumper, Slice, SliceResult


class PassRunner:
    """The scheduler's ``step``: called with the slices of one pass, off the event loop."""

    def __init__(
        self, engine: PackedEngine, dump_root: Path, model_name: str, server_name: str
    ) -> None:
        self._engine = engine
        self._root = dump_root
        config = HookConfig(
            dump_root=dump_root, aux_layers=engine.aux_layers, model=model_name, server=server_name
        )
        self.dumper = PrefillDumper(config)
        self._passes = PassDumper(self.dumper, len(engine.aux_layers) + 1)

    def drop(self, job: Job) -> None:
        """The scheduler removed ``job``: its dump, if unfinished, must never commit."""
        self._passes.drop(job)

    def __call__(self, slices: Sequence[Slice]) -> list[SliceResult]:
        segments = [
            Segment(s.job.tokens[s.start : s.end], s.start, s.job.kv, s.want_next, s.job.picker)
            for s in slices
        ]
        outputs = self._engine.forward(segments)
        views = self._passes.views(slices)
        storage = uniform_storage(views)
        errors = self._passes.dump(views, lambda: self._hidden(outputs, storage))
        return [
            SliceResult(kv=out.kv, next_token=out.next_token, error=self._error(s, errors))
            for s, out in zip(slices, outputs, strict=True)
        ]

    def _hidden(self, outputs: Sequence[SegmentOutput], storage: Storage | None) -> PassRows:
        """The pass's rows in batch order: aux ``[T, K, H]`` and final ``[T, H]`` bits; or,
        when every hsx request of the pass asks for one FP8 storage, the pass quantized
        here, where the model produced its rows (the hook's own quantizer)."""
        hidden = torch.cat([out.hidden for out in outputs])
        layers = self._engine.aux_layers
        if storage is not None:
            t = hidden.shape[0]
            sections = encode_rows(hidden, storage)
            return EncodedPass(
                storage=storage,
                sections=tuple(s.view(torch.uint8).reshape(t, -1).numpy() for s in sections),
                aux_layers=layers,
                hidden_size=int(hidden.shape[-1]),
            )
        rows = hidden.view(torch.int16).numpy()
        k = len(layers)
        return BatchHidden(aux=rows[:, :k], final=rows[:, k], aux_layers=layers)

    def _error(self, s: Slice, errors: dict[str, str]) -> str | None:
        """A refused or failed dump fails that request only; the others of the pass stand."""
        reason = errors.get(s.job.rid) if s.job.ns is not None else None
        if reason is None:
            return None
        return f"cannot write the dump of rid {s.job.rid} under {self._root}: {reason}"
