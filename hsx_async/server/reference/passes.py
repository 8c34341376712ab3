"""One pass of the reference server, run in a worker thread: the packed forward of the
scheduled slices, then each hsx request's part (and, after its last part, its meta.json).

Imports torch (through :mod:`.reference_model`); :mod:`.reference` imports it lazily.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from hsx_async.errors import DumpError
from hsx_async.server.dumpwrite import request_dir_fd, write_meta, write_part
from hsx_async.server.reference.model import PackedEngine, Segment, bf16_bytes
from hsx_async.server.reference.sched import Slice, SliceResult


class PassRunner:
    """The scheduler's ``step``: called with the slices of one pass, off the event loop."""

    def __init__(
        self, engine: PackedEngine, dump_root: Path, model_name: str, server_name: str
    ) -> None:
        self._engine = engine
        self._root = dump_root
        self._model_name = model_name
        self._server_name = server_name

    def __call__(self, slices: Sequence[Slice]) -> list[SliceResult]:
        segments = [
            Segment(s.job.tokens[s.start : s.end], s.start, s.job.kv, s.want_next, s.job.picker)
            for s in slices
        ]
        outputs = self._engine.forward(segments)
        return [
            SliceResult(kv=out.kv, next_token=out.next_token, error=self._dump(s, out.hidden))
            for s, out in zip(slices, outputs, strict=True)
        ]

    def _dump(self, s: Slice, hidden: torch.Tensor) -> str | None:
        """Write this pass's part of an hsx request; commit meta.json after its last one.

        A failure fails this request only: the others of the pass are written.
        """
        dump = s.job.dump
        if dump is None:
            return None
        try:
            with request_dir_fd(self._root, dump.ns, dump.rid) as fd:
                write_part(fd, s.start, s.end, bf16_bytes(hidden))
                dump.add_part(s.start, s.end)
                if dump.complete:
                    meta = dump.meta(
                        hidden_size=self._engine.hidden_size,
                        aux_layers=list(self._engine.aux_layers),
                        model=self._model_name,
                        server=self._server_name,
                    )
                    write_meta(fd, meta)
        except (OSError, DumpError) as exc:
            return f"cannot write the dump of rid {dump.rid} under {self._root}: {exc}"
        return None
