"""Hostile records: whatever a line holds, ``prepare`` never crashes, never loses it, and
every sample it writes is a valid PROTOCOL §1 line whose mask trains something."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsx_async.prepare.encode import EncodeOptions, RecordEncoder
from hsx_async.prepare.pipeline import PreparePaths, run_prepare

ROLES = ["user", "assistant", "system", "human", "gpt", "tool", "", "USER", None, 3]
TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["<|im_end|>", "<|im_start|>assistant\n", "hello world", " ", "\n\n"]),
    st.text(alphabet="ab <|>\n_", max_size=20),
)
INT = st.integers(-(2**63), 2**63 - 1)
JSON_SCALAR = st.one_of(st.none(), st.booleans(), INT, st.floats(), TEXT)
CONTENT = st.one_of(TEXT, JSON_SCALAR, st.lists(JSON_SCALAR, max_size=3))


def _turn(role_key: str, content_key: str) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.fixed_dictionaries(
            {role_key: st.sampled_from(ROLES), content_key: CONTENT},
            optional={"name": TEXT},
        ),
        JSON_SCALAR,
    )


RECORD = st.one_of(
    st.fixed_dictionaries(
        {"messages": st.lists(_turn("role", "content"), max_size=6)},
        optional={"id": st.one_of(JSON_SCALAR, st.lists(INT, max_size=2))},
    ),
    st.fixed_dictionaries({"conversations": st.lists(_turn("from", "value"), max_size=6)}),
    st.dictionaries(TEXT, JSON_SCALAR, max_size=3),
    st.lists(JSON_SCALAR, max_size=3),
)
# Well-formed conversations with hostile text: the ones that get as far as the template.
WORDS = st.one_of(TEXT.filter(str.strip), st.sampled_from(["x <|im_end|>", "é\u200b\t!"]))
PLAUSIBLE = st.tuples(
    st.one_of(st.none(), WORDS),
    st.lists(st.tuples(WORDS, WORDS), min_size=1, max_size=3),
).map(
    lambda sp: {
        "messages": ([{"role": "system", "content": sp[0]}] if sp[0] else [])
        + [
            {"role": r, "content": c}
            for user, answer in sp[1]
            for r, c in (("user", user), ("assistant", answer))
        ]
    }
)
LINE = st.one_of(
    st.just(b'{"id": 99999999999999999999999, "messages": []}'),
    RECORD.map(orjson.dumps),
    PLAUSIBLE.map(orjson.dumps),
    st.binary(max_size=60),
)


@pytest.fixture(scope="module")
def encoder(tokenizer_dirs: dict[str, Path]) -> RecordEncoder:
    return RecordEncoder(EncodeOptions(tokenizer=tokenizer_dirs["chatml"], max_tokens=64))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=LINE)
def test_any_line_is_a_valid_sample_or_a_reason(encoder: RecordEncoder, raw: bytes) -> None:
    if b"\n" in raw:
        raw = raw.replace(b"\n", b" ")  # one line: the reader splits on newlines
    outcome = encoder.outcome(5, raw)
    assert outcome.line == 5
    if outcome.reason:
        assert not outcome.line_json
        return
    sample = orjson.loads(outcome.line_json)
    ids, mask = sample["input_ids"], sample["loss_mask"]
    assert len(ids) == len(mask) <= 64 and ids
    assert set(mask) <= {0, 1} and sum(mask) == outcome.trainable > 0
    assert all(type(t) is int and t >= 0 for t in ids)
    # Every assistant answer, with its end-of-turn token, is inside the trainable tokens.
    record = orjson.loads(raw)
    turns = record.get("messages") or record.get("conversations")
    answers = [
        t.get("content", t.get("value")) for t in turns
        if t.get("role", t.get("from")) in ("assistant", "gpt")
    ]  # fmt: skip
    tok = encoder.chat.tokenizer
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    untrained = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    for answer in answers:
        assert answer + "<|im_end|>" in trained
    assert "<|im_start|>assistant" in untrained and "<|im_start|>assistant" not in trained


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(LINE, min_size=1, max_size=12))
def test_every_line_ends_in_exactly_one_file(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dirs: dict[str, Path], lines: list[bytes]
) -> None:
    tmp = tmp_path_factory.mktemp("hostile")
    src = tmp / "in.jsonl"
    src.write_bytes(
        b"".join(line.replace(b"\n", b" ").replace(b"\r", b" ") + b"\n" for line in lines)
    )
    paths = PreparePaths.beside(src, tmp / "out.jsonl")
    summary = run_prepare(EncodeOptions(tokenizer=tokenizer_dirs["chatml"]), paths)
    samples = paths.out.read_bytes().splitlines()
    quarantined = [orjson.loads(q) for q in paths.quarantine.read_bytes().splitlines()]
    assert summary["records"] == len(lines) == len(samples) + len(quarantined)
    assert summary["samples"] == len(samples)
    assert len({q["line"] for q in quarantined}) == len(quarantined)
    assert all(q["reason"] for q in quarantined)
