"""What a dataset was made from, and the lock that keeps two runs off one shard.

``provenance.json`` in the output directory records the input fingerprint, the model shape
and (once a server answered) the model and server version, plus the config. A resume
against another input or shape is refused — mixing them would make a dataset whose rows
mean two different things — unless the operator passes ``--allow-provenance-change``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from hsx_async import __version__
from hsx_async.config import Config, flatten_public
from hsx_async.dataset.durable import exclusive_lock, write_atomic
from hsx_async.dataset.manifest import hash_file
from hsx_async.errors import DatasetError
from hsx_async.protocol import PROTOCOL_VERSION

PROVENANCE = "provenance.json"


def fingerprint(path: Path) -> dict[str, Any]:
    """Size and XXH3-64 of the whole input file (blocking; ~0.1 s/GB from page cache)."""
    size, digest = hash_file(path, follow_symlinks=True)
    return {"path": str(path), "bytes": size, "xxh3_64": digest}


def _json_safe(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_json_safe(v) for v in value]
    return value


@dataclass(frozen=True)
class Provenance:
    input: dict[str, Any]
    hidden_size: int
    aux_layers: list[int]
    config: dict[str, Any]
    model: str = ""
    server: str = ""

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "protocol": PROTOCOL_VERSION,
                "hsx": __version__,
                "input": self.input,
                "hidden_size": self.hidden_size,
                "aux_layers": self.aux_layers,
                "model": self.model,
                "server": self.server,
                "config": self.config,
            },
            option=orjson.OPT_INDENT_2,
        )


def provenance_for(
    config: Config, input_fp: dict[str, Any], model: str = "", server: str = ""
) -> Provenance:
    return Provenance(
        input=input_fp,
        hidden_size=config.model.hidden_size,
        aux_layers=list(config.model.aux_layers),
        config={k: _json_safe(v) for k, v in flatten_public(config).items()},
        model=model,
        server=server,
    )


def read_provenance(out_dir: Path) -> dict[str, Any] | None:
    try:
        data = (out_dir / PROVENANCE).read_bytes()
    except FileNotFoundError:
        return None
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise DatasetError(
            f"{out_dir / PROVENANCE} is not valid JSON; restore or remove it"
        ) from None
    if not isinstance(raw, dict):
        raise DatasetError(f"{out_dir / PROVENANCE} is not a JSON object")
    return raw


def mismatches(old: dict[str, Any], new: Provenance) -> list[str]:
    """Why ``new`` may not extend the dataset recorded in ``old`` (empty: it may)."""
    found = []
    old_in = old.get("input", {})
    if (old_in.get("bytes"), old_in.get("xxh3_64")) != (new.input["bytes"], new.input["xxh3_64"]):
        found.append(
            f"input differs: the dataset was made from {old_in.get('path')} "
            f"({old_in.get('bytes')} bytes, xxh3 {old_in.get('xxh3_64')}), this run reads "
            f"{new.input['path']} ({new.input['bytes']} bytes, xxh3 {new.input['xxh3_64']})"
        )
    if old.get("hidden_size") != new.hidden_size or old.get("aux_layers") != new.aux_layers:
        found.append(
            f"model shape differs: dataset has hidden_size {old.get('hidden_size')}, aux_layers "
            f"{old.get('aux_layers')}; config has {new.hidden_size}, {new.aux_layers}"
        )
    if new.model and old.get("model") and old.get("model") != new.model:
        found.append(
            f"model differs: dataset made with {old.get('model')!r}, server now serves "
            f"{new.model!r}"
        )
    return found


def write_provenance(out_dir: Path, data: bytes) -> None:
    write_atomic(out_dir / PROVENANCE, data)


def check_and_record(out_dir: Path, record: Provenance, *, allow_change: bool) -> None:
    old = read_provenance(out_dir)
    if old is not None:
        problems = mismatches(old, record)
        if problems and not allow_change:
            raise DatasetError(
                f"{out_dir} belongs to another run: " + "; ".join(problems) + ". Use a new "
                "output.dir, or pass --allow-provenance-change if this is intended"
            )
        if not problems and (old.get("model") or not record.model):
            return  # nothing new to record
    write_provenance(out_dir, record.to_json())


def record_input_count(out_dir: Path, samples: int) -> None:
    """Add the number of input samples (for ``hsx status``) once a run has counted them."""
    old = read_provenance(out_dir)
    if old is not None and old.get("input_samples") != samples:
        old["input_samples"] = samples
        write_provenance(out_dir, orjson.dumps(old, option=orjson.OPT_INDENT_2))


@contextlib.contextmanager
def shard_lock(out_dir: Path, shard_index: int) -> Iterator[None]:
    """An exclusive lock per (output dir, shard): two runs appending to one manifest
    would interleave lines and delete each other's files as orphans."""
    with exclusive_lock(
        out_dir / f".hsx-shard-{shard_index}.lock",
        f"another hsx process is writing shard {shard_index} of {out_dir}; stop it "
        "first, or give this run another output.dir or [shard].index",
    ):
        yield
