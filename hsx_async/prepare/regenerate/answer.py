"""One turn of ``hsx regenerate``: the decode request's sampling and the check of its answer.

The server is untrusted (README, "Guarantees"). An answer is written only when every id in
it is a token of the job's tokenizer (``0 <= id < len(tokenizer)``: a negative id crashes
the tokenizer's decode, an id past the vocabulary decodes to nothing and would vanish from
the text) and there are no more of them than the request asked for
(``max_new_tokens``, the stop token included, as both engines count). Anything else is
the server's fault (:class:`~hsx_async.errors.AnswerError`): the attempt fails, the
conversation is not charged for it, and nothing of the answer is kept.

Pure: no sockets, no files.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

import xxhash

from hsx_async.dataset.layout import canonical_id
from hsx_async.engines import Decoded, Decoding
from hsx_async.errors import AnswerError

_MAX_SEED = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class Answer:
    output_ids: list[int]  # without the trailing stop token(s)
    length_capped: bool  # cut by max_new_tokens


def turn_seed(seed: int, sample_id: str | int, turn: int) -> int:
    """The sampling seed of one turn: the same in every run, so a resumed run samples the
    same answers, and different for every conversation and turn."""
    key = f"{seed}:{canonical_id(sample_id)}:{turn}".encode()
    return xxhash.xxh3_64_intdigest(key) & _MAX_SEED


def check_answer(decoded: Decoded, decoding: Decoding, *, rid: str, vocab_size: int) -> Answer:
    """The answer's ids, checked against the request and the tokenizer; the trailing stop
    tokens dropped. :class:`AnswerError` when the server answered what it cannot have."""
    ids = decoded.ids
    if len(ids) > decoding.max_new_tokens:  # before looking at each: it may be huge
        raise AnswerError(
            f"answer to {rid}: {len(ids)} token ids for max_new_tokens = "
            f"{decoding.max_new_tokens}; the server ignored the request's length"
        )
    for position, token in enumerate(ids):
        if type(token) is not int or not 0 <= token < vocab_size:  # a JSON bool is no id
            raise AnswerError(
                f"answer to {rid}: token id {token!r} at position {position} is not in the "
                f"tokenizer's vocabulary [0, {vocab_size}) (is regenerate.tokenizer the "
                "model this server serves?)"
            )
    return Answer(_without_stops(ids, frozenset(decoding.stop_ids)), decoded.finish == "length")


def _without_stops(ids: list[int], stops: Set[int]) -> list[int]:
    end = len(ids)
    while end and ids[end - 1] in stops:
        end -= 1
    return ids[:end]
