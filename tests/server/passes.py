"""Shared test helpers for the server's pass planning, row layout and dumps: request views,
bit-pattern rows, a dumper and a reader that checks a dump as the client does."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsx_async.protocol import (
    META_NAME,
    Storage,
    check_meta,
    check_part_sizes,
    parse_meta,
    parse_part_name,
    row_bytes,
    storage_params,
)
from hsx_async.server.dumper import PrefillDumper
from hsx_async.server.hook_core import HookConfig, ReqView, request_storage
from hsx_async.server.rows import BatchHidden, EncodedPass, PassRows, assemble_rows, encode_bits

NS = "w0"
H = 4
LAYERS = (2, 5)
K = len(LAYERS)


def view(
    rid: object,
    rows: int,
    *,
    start: int = 0,
    num_tokens: int | None = None,
    ns: object | None = NS,
    max_new_tokens: object = 0,
    last: bool = True,
    retracted: bool = False,
    aborted: bool = False,
) -> ReqView:
    return ReqView(
        rid=rid,
        ns=ns,
        num_tokens=num_tokens if num_tokens is not None else start + rows,
        max_new_tokens=max_new_tokens,
        start=start,
        rows=rows,
        last_chunk=last,
        retracted=retracted,
        aborted=aborted,
    )


def plain(rows: int) -> ReqView:
    """Ordinary traffic: no hsx_ns."""
    return view("user-req", rows, ns=None, max_new_tokens=128)


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def batch_arrays(total: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Distinct bit patterns for every (row, slice, column): aux [T, K*H], final [T, H]."""
    rng = np.random.default_rng(seed)
    aux = rng.integers(0, 2**16, size=(total, K * H), dtype=np.uint16)
    final = rng.integers(0, 2**16, size=(total, H), dtype=np.uint16)
    return aux, final


def expected_rows(aux: np.ndarray, final: np.ndarray, row: int, count: int) -> np.ndarray:
    out = np.zeros((count, K + 1, H), dtype=np.uint16)
    for r in range(count):
        for k in range(K):
            out[r, k] = aux[row + r, k * H : (k + 1) * H]
        out[r, K] = final[row + r]
    return out


def make_dumper(root: Path, max_open: int = 64) -> PrefillDumper:
    cfg = HookConfig(
        dump_root=root, aux_layers=LAYERS, model=None, server="sglang test", max_open=max_open
    )
    return PrefillDumper(cfg, model="tiny-model")


def loader(aux: np.ndarray, final: np.ndarray) -> Callable[[], BatchHidden]:
    return lambda: BatchHidden(aux=aux, final=final, aux_layers=LAYERS)


def read_dump(root: Path, rid: str) -> tuple[np.ndarray, int]:
    """The committed dump of ``rid``, checked as the client checks it; (rows, num_tokens)."""
    d = root / NS / rid
    meta = parse_meta((d / META_NAME).read_bytes())
    check_meta(meta, rid=rid, num_tokens=meta.num_tokens, hidden_size=H, aux_layers=LAYERS)
    sizes = {
        span: (d / name).stat().st_size
        for name in names(d)
        if (span := parse_part_name(name)) is not None
    }
    check_part_sizes(meta, sizes, row_bytes(H, LAYERS))
    assert meta.model == "tiny-model" and meta.server == "sglang test"
    assert not [n for n in names(d) if n.startswith(".")]
    parts = [
        np.fromfile(d / f"part-{s:010d}-{e:010d}.bin", dtype="<u2").reshape(e - s, K + 1, H)
        for s, e in meta.parts
    ]
    return np.concatenate(parts), meta.num_tokens


def finite_arrays(total: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Finite bfloat16 rows of very different magnitudes per (row, slice): aux [T, K*H],
    final [T, H], as bit patterns."""
    rng = np.random.default_rng(seed)
    gains = 10.0 ** rng.uniform(-3, 3, size=(total, K + 1, 1))
    rows = torch.from_numpy(rng.standard_normal((total, K + 1, H)) * gains).to(torch.bfloat16)
    bits = rows.view(torch.int16).numpy().view(np.uint16)
    return np.ascontiguousarray(bits[:, :K].reshape(total, K * H)), np.ascontiguousarray(bits[:, K])


def fp8_params(storage: Storage) -> dict[str, object]:
    return {"hsx_ns": NS, **storage_params(storage)}


def fp8_view(rid: str, rows: int, storage: Storage, **kw: Any) -> ReqView:
    got, note = request_storage(fp8_params(storage), K + 1)
    assert (got, note) == (storage, "")
    return dataclasses.replace(view(rid, rows, **kw), storage=got)


def encoded_pass(aux: np.ndarray, final: np.ndarray, storage: Storage) -> EncodedPass:
    """The pass as a device would hand it over: every row's sections, [T, row bytes]."""
    rows = assemble_rows(BatchHidden(aux=aux, final=final, aux_layers=LAYERS), 0, len(aux))
    t = rows.shape[0]
    sections = tuple(
        np.frombuffer(b, dtype=np.uint8).reshape(t, -1) for b in encode_bits(rows, storage)
    )
    return EncodedPass(storage=storage, sections=sections, aux_layers=LAYERS, hidden_size=H)


def pass_loader(
    aux: np.ndarray, final: np.ndarray, encoded: Storage | None
) -> Callable[[], PassRows]:
    """The pass's rows as bfloat16, or already encoded for ``encoded``."""
    hidden: PassRows = (
        BatchHidden(aux=aux, final=final, aux_layers=LAYERS)
        if encoded is None
        else encoded_pass(aux, final, encoded)
    )
    return lambda: hidden
