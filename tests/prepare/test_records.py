"""Conversation records: both input shapes, every refusal reason, system prompt policies."""

from __future__ import annotations

import orjson
import pytest

from hsx_async.prepare.records import (
    DERIVED_ID_PREFIX,
    BadRecord,
    Conversation,
    Turn,
    apply_system,
    parse_record,
)


def _parse(obj: object, **kw: object) -> Conversation | BadRecord:
    return parse_record(orjson.dumps(obj), 4, **kw)  # type: ignore[arg-type]


def test_sharegpt_and_openai_give_the_same_conversation() -> None:
    share = _parse(
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    )
    openai = _parse(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    )
    assert isinstance(share, Conversation) and isinstance(openai, Conversation)
    assert share.turns == openai.turns == (Turn("user", "hi"), Turn("assistant", "yo"))
    assert (share.source_format, openai.source_format) == ("sharegpt", "openai")
    # No id given: derived from the content, the same for both shapes and every run.
    assert share.id == openai.id and str(share.id).startswith(DERIVED_ID_PREFIX)
    assert share.line == 4


def test_a_given_id_is_kept() -> None:
    rec = _parse({"id": 17, "messages": [{"role": "user", "content": "a"},
                                         {"role": "assistant", "content": "b"}]})  # fmt: skip
    assert isinstance(rec, Conversation) and rec.id == 17


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "a JSON list, expected an object"),
        (b"{}", "neither 'conversations'"),
        (b'{"messages": [], "conversations": []}', "both"),
        (b'{"messages": []}', "not a non-empty list"),
        (b'{"messages": ["x"]}', "turn 0 is not an object"),
        (b'{"messages": [{"role": "tool", "content": "x"}]}', "unknown role 'tool'"),
        (b'{"messages": [{"role": "user", "content": 3}]}', "content is int"),
        (b'{"messages": [{"role": "user"}]}', "content is missing"),
        (b'{"messages": [{"role": "user", "content": "  "}]}', "empty content"),
        (b'{"messages": [{"role": "user", "content": "a\\u0000"}]}', "NUL"),
        (b'{"messages": [{"role": "user", "content": "a"}]}', "no assistant turn"),
        (b'{"messages": [{"role": "assistant", "content": "a"}]}', "first turn"),
        (b'{"id": [1], "messages": []}', "id"),
        (b'{"id": -1, "messages": []}', "id"),
    ],
)
def test_bad_records_name_their_reason(raw: bytes, reason: str) -> None:
    rec = parse_record(raw, 9)
    assert isinstance(rec, BadRecord), rec
    assert rec.line == 9
    assert reason in rec.reason


def test_system_policies() -> None:
    turns = [Turn("system", "s"), Turn("user", "u"), Turn("assistant", "a")]
    bare = turns[1:]
    assert apply_system(turns, "keep", "p") == turns
    assert apply_system(bare, "keep", "p") == [Turn("system", "p"), *bare]
    assert apply_system(bare, "keep", None) == bare
    assert apply_system(turns, "drop", "p") == bare
    assert apply_system(turns, "override", "p") == [Turn("system", "p"), *bare]
    assert apply_system(turns, "override", None) == bare


def test_a_record_of_only_a_system_prompt_and_user_turns_is_refused_after_the_policy() -> None:
    raw = orjson.dumps({"messages": [{"role": "system", "content": "s"},
                                     {"role": "assistant", "content": "a"}]})  # fmt: skip
    assert isinstance(parse_record(raw, 0), Conversation)  # the system prompt precedes it
    dropped = parse_record(raw, 0, system="drop")
    assert isinstance(dropped, BadRecord) and "first turn" in dropped.reason
