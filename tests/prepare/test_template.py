"""The assistant loss mask, token by token, on local tokenizers with real template styles.

Each expectation comes from the style's hand-written pieces (tests/prepare/chat_styles.py),
tokenized piece by piece: it never goes through the template or the span logic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from hsx_async.prepare.records import Conversation, parse_record
from hsx_async.prepare.template import (
    ChatEncoder,
    RecordError,
    assistant_spans,
    load_tokenizer,
    mask_from_offsets,
)
from tests.prepare.chat_styles import STYLES, expected

Msgs = list[dict[str, str]]

SINGLE: Msgs = [
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the quick brown fox"},
]
MULTI: Msgs = [
    {"role": "system", "content": "You are a lazy dog."},
    {"role": "user", "content": "how are you today?"},
    {"role": "assistant", "content": "hello, 42 jumps!"},
    {"role": "user", "content": "question: answer 7"},
    {"role": "assistant", "content": "model token over the dog"},
    {"role": "user", "content": "and now?"},
    {"role": "assistant", "content": "numbers 0 1 2"},
]
# The assistant turn holds text that equals the end-of-turn string of no style but looks
# like template text, and a user turn repeats the assistant's words: spans are positions.
TRICKY: Msgs = [
    {"role": "user", "content": "assistant: the quick brown fox"},
    {"role": "assistant", "content": "the quick brown fox"},
    {"role": "user", "content": "the quick brown fox"},
    {"role": "assistant", "content": "user\n\nassistant"},
]


def _conv(messages: Msgs) -> Conversation:
    rec = parse_record(orjson.dumps({"messages": messages}), 0)
    assert isinstance(rec, Conversation), rec
    return rec


def _encoder(tokenizer_dirs: dict[str, Path], style: str) -> tuple[ChatEncoder, Any]:
    tok = load_tokenizer(tokenizer_dirs[style])
    return ChatEncoder(tok, tok.chat_template), tok


def _show(tok: Any, ids: list[int], mask: list[int]) -> list[tuple[str, int]]:
    return [(tok.decode([i]), m) for i, m in zip(ids, mask, strict=True)]


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("messages", [SINGLE, MULTI, TRICKY], ids=["single", "multi", "tricky"])
def test_mask_matches_the_hand_written_rendering(
    tokenizer_dirs: dict[str, Path], style: str, messages: Msgs
) -> None:
    enc, tok = _encoder(tokenizer_dirs, style)
    got = enc.encode(_conv(messages))
    want_ids, want_mask = expected(tok, STYLES[style], messages)
    assert got.input_ids == want_ids, "the template renders what the style's pieces say"
    assert _show(tok, got.input_ids, got.loss_mask) == _show(tok, want_ids, want_mask)


@pytest.mark.parametrize("style", sorted(STYLES))
def test_the_end_of_turn_token_is_trainable_and_headers_are_not(
    tokenizer_dirs: dict[str, Path], style: str
) -> None:
    enc, tok = _encoder(tokenizer_dirs, style)
    got = enc.encode(_conv(MULTI))
    eot = tok.convert_tokens_to_ids(STYLES[style].eos)
    trained = [i for i, m in zip(got.input_ids, got.loss_mask, strict=True) if m]
    assert trained.count(eot) == 3  # one per assistant turn
    # Every trainable token decodes to assistant text or the end-of-turn marker.
    assistant_text = "".join(m["content"] for m in MULTI if m["role"] == "assistant")
    for token in trained:
        piece = tok.decode([token])
        assert token == eot or piece.strip() in assistant_text, piece


def test_llama3_has_one_bos_although_its_tokenizer_adds_one(
    tokenizer_dirs: dict[str, Path],
) -> None:
    enc, tok = _encoder(tokenizer_dirs, "llama3")
    bos = tok.bos_token_id
    # The tokenizer itself would add BOS in front of the template's: two.
    assert tok("x")["input_ids"][0] == bos
    got = enc.encode(_conv(SINGLE))
    assert got.input_ids[0] == bos and got.input_ids[1] != bos


def test_chatml_default_system_prompt_is_not_trainable(tokenizer_dirs: dict[str, Path]) -> None:
    enc, tok = _encoder(tokenizer_dirs, "chatml")
    got = enc.encode(_conv(SINGLE))
    text = tok.decode([i for i, m in zip(got.input_ids, got.loss_mask, strict=True) if not m])
    assert "You are Qwen" in text  # rendered by the template, and masked 0


def test_generation_markers_and_prefix_spans_agree(tokenizer_dirs: dict[str, Path]) -> None:
    marked, _ = _encoder(tokenizer_dirs, "chatml-marked")
    plain, _ = _encoder(tokenizer_dirs, "chatml")
    assert marked.markers and not plain.markers
    for messages in (SINGLE, MULTI, TRICKY):
        assert marked.encode(_conv(messages)) == plain.encode(_conv(messages))


def test_a_template_that_rewrites_earlier_turns_is_refused(
    tokenizer_dirs: dict[str, Path],
) -> None:
    # Like Qwen3 dropping earlier reasoning: the last assistant turn renders differently.
    template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'assistant' and not loop.last %}(earlier){%- else %}{{ m.content }}"
        "{%- endif %}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    tok = load_tokenizer(tokenizer_dirs["chatml"])
    enc = ChatEncoder(tok, template)
    with pytest.raises(RecordError, match="differently once later turns follow"):
        enc.encode(_conv(MULTI))
    assert enc.encode(_conv(SINGLE)).trainable > 0  # one turn: nothing follows it


def test_control_tokens_in_content_are_refused(tokenizer_dirs: dict[str, Path]) -> None:
    enc, _ = _encoder(tokenizer_dirs, "chatml")
    bad = [{"role": "user", "content": "hi<|im_end|>"}, {"role": "assistant", "content": "x"}]
    with pytest.raises(RecordError, match=r"turn 0 \(user\) holds the control token"):
        enc.encode(_conv(bad))


def test_bos_twice_is_refused(tokenizer_dirs: dict[str, Path]) -> None:
    tok = load_tokenizer(tokenizer_dirs["deepseek"])
    enc = ChatEncoder(tok, "{{ bos_token }}" + STYLES["deepseek"].template)
    with pytest.raises(RecordError, match="BOS twice"):
        enc.encode(_conv(SINGLE))


def test_a_failing_template_is_a_record_error(tokenizer_dirs: dict[str, Path]) -> None:
    tok = load_tokenizer(tokenizer_dirs["chatml"])
    enc = ChatEncoder(tok, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(RecordError, match="roles must alternate"):
        enc.encode(_conv(SINGLE))


def test_assistant_spans_with_a_plain_render() -> None:
    def render(messages: Msgs, gen: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</t>\n" for m in messages)
        return text + ("<assistant>" if gen else "")

    full, spans = assistant_spans(render, SINGLE)
    assert [full[a:b] for a, b in spans] == ["the quick brown fox</t>"]


def test_mask_from_offsets_overlap_rule() -> None:
    offsets = [(0, 3), (3, 5), (5, 9), (9, 9), (9, 12)]
    assert mask_from_offsets(offsets, [(4, 9)]) == [0, 1, 1, 0, 0]
    assert mask_from_offsets(offsets, [(0, 1), (10, 11)]) == [1, 0, 0, 0, 1]
    assert mask_from_offsets(offsets, []) == [0] * 5
