"""What an engine is, as the client sees it: the descriptor each engine module fills in.

Two requests cross the wire. The *prefill* (``hsx run``): one marked prompt whose hidden
states the engine's hsx hook dumps (PROTOCOL §2); its response is checked, the rows are in
the dump. The *decode* (``hsx regenerate``): an ordinary sampled completion of token ids,
no dump; the answer's wire form is parsed here, its values are checked by the caller
against the tokenizer and the request (:mod:`hsx_async.prepare.regenerate.answer`).

Pure: no sockets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from hsx_async.protocol import Storage

if TYPE_CHECKING:
    from hsx_async.engines import EngineName

Finish = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class Decoding:
    """The sampling of one decode request (``[regenerate]``, with the turn's seed)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decode answer as the wire gave it: ``ids`` not yet checked against anything but
    their JSON type (a list; the caller checks each id)."""

    ids: list[Any]
    finish: Finish


@dataclass(frozen=True)
class Engine:
    name: EngineName
    generate_path: str
    build_body: Callable[[str, str, Any, Storage], dict[str, Any]]
    check: Callable[[object, str, int], None]
    model_info_path: str
    model_of: Callable[[object], str]
    version_path: str
    # Where a prefix-cache hit would be reported, and the flag that prevents it.
    no_cache_flag: str
    # hsx regenerate: a sampled completion of (rid, prompt ids, decoding), and its answer
    # (body, rid, prompt length) → Decoded, or AnswerError naming what is wrong.
    decode_path: str
    decode_body: Callable[[str, Sequence[int], Decoding], dict[str, Any]]
    parse_decode: Callable[[object, str, int], Decoded]
    # A dump that did not appear although the request was answered: ``acks_mark`` says
    # the answer itself proves the hook took the request (vLLM's connector echoes the rid),
    # so the dump went elsewhere (dump.root); else the hook may not be loaded, and
    # ``deploy`` is where its launch is described.
    acks_mark: bool
    deploy: str


def is_count(value: object) -> bool:
    return type(value) is int  # bool is an int subclass: True must not pass as 1
