"""One regenerate turn's answer, checked against the tokenizer and the request (pure)."""

from __future__ import annotations

import pytest

from hsx_async.engines import Decoded, Decoding
from hsx_async.errors import AnswerError
from hsx_async.prepare.regenerate.answer import Answer, check_answer, turn_seed

DECODING = Decoding(max_new_tokens=8, temperature=0.0, top_p=1.0, seed=3, stop_ids=(2, 9))


def test_turn_seed_is_stable_and_distinct() -> None:
    assert turn_seed(1, "a", 2) == turn_seed(1, "a", 2)
    assert len({turn_seed(1, "a", 2), turn_seed(1, "a", 4), turn_seed(1, "b", 2),
                turn_seed(2, "a", 2)}) == 4  # fmt: skip
    assert 0 <= turn_seed(0, 7, 1) < 2**63


def test_a_good_answer_loses_only_its_stop_tokens() -> None:
    got = check_answer(Decoded([5, 6, 9, 2], "stop"), DECODING, rid="r", vocab_size=10)
    assert got == Answer([5, 6], length_capped=False)
    got = check_answer(Decoded([5, 9, 6] * 2 + [0, 0], "length"), DECODING, rid="r", vocab_size=10)
    assert got == Answer([5, 9, 6, 5, 9, 6, 0, 0], length_capped=True)  # a stop id mid-answer
    assert check_answer(Decoded([], "stop"), DECODING, rid="r", vocab_size=10).output_ids == []


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([5, -1, 6], "token id -1 at position 1 is not in the tokenizer's vocabulary"),
        ([5, 10], r"token id 10 at position 1 .*\[0, 10\)"),
        ([5, True], "token id True"),
        ([5, 6.0], "token id 6.0"),
        (["5"], "token id '5'"),
        ([7] * 50_000, "50000 token ids for max_new_tokens = 8"),
        ([7] * 9, "9 token ids for max_new_tokens = 8"),
    ],
)
def test_an_answer_no_honest_server_gives_is_refused(ids: list[object], match: str) -> None:
    with pytest.raises(AnswerError, match=match):
        check_answer(Decoded(ids, "length"), DECODING, rid="r", vocab_size=10)
