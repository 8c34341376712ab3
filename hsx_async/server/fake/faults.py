"""What the fake server's injected faults do to a dump and an answer: its only difference
from a hook. The catalogue and the draw are in :mod:`.options`; the HTTP-level faults
(``http_500``, ``drop_before``, ``drop_after``, ``hang``) in :mod:`.app`.

:class:`DumpFaults` is the :class:`~hsx_async.server.dumpwrite.Tamper` the fake hands the
one dump writer: a request's fault changes only its last part or its commit, so every
other part is written exactly as a hook writes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hsx_async.protocol import OUTLIER_INDEX, DumpMeta
from hsx_async.server.dumpwrite import Chunks
from hsx_async.server.fake.options import FakeOptions
from hsx_async.server.hook_core import PartWrite

# Faults on the last part's file(s) and on meta.json; the commit is withheld for two.
PART_FAULTS = frozenset({"truncated_part", "oversized_part", "gap_parts", "overlap_parts"})
META_FAULTS = frozenset({"wrong_num_tokens", "wrong_hidden_size", "wrong_layers"})
NO_COMMIT_FAULTS = frozenset({"abort_dump", "late_meta"})
DUMP_FAULTS = PART_FAULTS | META_FAULTS | NO_COMMIT_FAULTS


def _flat(chunks: Chunks) -> bytes:
    return b"".join(bytes(b) for buffers in chunks for b in buffers)


class DumpFaults:
    """The dump faults of the requests in flight, by rid (armed when a request is accepted,
    disarmed when it is answered), applied by the writer threads."""

    def __init__(self, options: FakeOptions | None = None) -> None:
        self._options = options or FakeOptions()
        self._faults: dict[str, str] = {}
        # late_meta: the commit a request's last part would have made, for the late commit.
        self.withheld: dict[str, DumpMeta] = {}

    def arm(self, rid: str, fault: str | None) -> None:
        if fault in DUMP_FAULTS:
            self._faults[rid] = fault

    def disarm(self, rid: str) -> None:
        self._faults.pop(rid, None)

    def fault_of(self, rid: str) -> str | None:
        return self._faults.get(rid)

    def part(self, write: PartWrite, chunks: Chunks) -> list[tuple[int, int, Chunks]]:
        if self._options.bad_outliers and write.storage.outliers:
            chunks = self._outlier_past_h(write, chunks)
        fault = self._faults.get(write.rid)
        start, end = write.start, write.end
        if fault not in PART_FAULTS or not write.last:
            return [(start, end, chunks)]
        data = _flat(chunks)  # one faulty request's last part: small
        row = len(data) // write.rows
        if fault == "truncated_part":  # shorter than its name says
            return [(start, end, [[memoryview(data[: len(data) - max(1, row // 2)])]])]
        if fault == "oversized_part":  # one row longer than its name says
            return [(start, end, [[memoryview(data + data[-row:])]])]
        if fault == "gap_parts":  # named (and listed) one row later: a gap
            return [(start + 1, end + 1, [[memoryview(data)]])]
        # overlap_parts: an extra part [T-1, T), written and listed
        return [(start, end, [[memoryview(data)]]), (end - 1, end, [[memoryview(data[-row:])]])]

    def _outlier_past_h(self, write: PartWrite, chunks: Chunks) -> Chunks:
        """The part with its first vector's first outlier channel set to H (past it)."""
        o = self._options
        data = bytearray(_flat(chunks))
        at = 0
        for section in write.storage.sections(len(o.aux_layers) + 1, o.hidden_size):
            if section.name == OUTLIER_INDEX:
                data[at : at + 2] = o.hidden_size.to_bytes(2, "little")
                break
            at += write.rows * section.row_bytes
        return [[memoryview(data)]]

    def meta(self, write: PartWrite, meta: DumpMeta) -> DumpMeta | None:
        fault = self._faults.get(write.rid)
        if fault == "abort_dump":
            return None
        if fault == "late_meta":
            self.withheld[write.rid] = meta
            return None
        return faulty_meta(meta, fault)


def faulty_meta(meta: DumpMeta, fault: str | None) -> DumpMeta:
    """``meta.json`` as a fault lists or misstates it."""
    start, end = meta.parts[-1]
    if fault == "gap_parts":
        return dataclasses.replace(meta, parts=(*meta.parts[:-1], (start + 1, end + 1)))
    if fault == "overlap_parts":
        return dataclasses.replace(meta, parts=(*meta.parts, (end - 1, end)))
    if fault == "wrong_num_tokens":
        return dataclasses.replace(meta, num_tokens=meta.num_tokens + 1)
    if fault == "wrong_hidden_size":
        return dataclasses.replace(meta, hidden_size=meta.hidden_size + 1)
    if fault == "wrong_layers":
        layers = meta.aux_layers or (0,)
        return dataclasses.replace(meta, aux_layers=(*layers[:-1], layers[-1] + 1))
    return meta


def faulty_answer(body: dict[str, Any], fault: str | None) -> dict[str, Any]:
    """SGLang's answer as a response fault misstates it."""
    meta = body["meta_info"]
    if fault == "wrong_rid":
        meta["id"] = f"{meta['id']}-not-mine"
    elif fault == "wrong_prompt_tokens":
        meta["prompt_tokens"] += 1
    elif fault == "cached_tokens":
        meta["cached_tokens"] = min(meta["prompt_tokens"], 16)
    return body
