"""Chat-template rendering and the assistant loss mask.

The mask is worked out from the rendered text, not from knowledge of any template, so it
is right for templates nobody special-cased:

* With ``{% generation %}`` markers in the template, the marked character spans are the
  assistant's (transformers' own renderer reports them).
* Otherwise, for each assistant turn *i*, the conversation is rendered cut before the turn
  with the generation prompt (``P``), and cut after it (``Q``). What ``Q`` adds after the
  text the two share is what the model produces when it answers: the content and the
  end-of-turn marker. Whitespace the template puts after the end-of-turn (ChatML's ``\\n``)
  is not produced by the model and stays 0. ``Q`` must be a prefix of the whole rendering,
  else the template rewrites earlier turns once later ones exist (the span would not be
  where the model sees it): such a record is refused with the reason.

A template's header may contain the end-of-turn text (``<|end|>assistant``): nothing here
searches for end-of-turn strings, so that cannot shift the mask.

Tokens come from one encoding of the whole rendering, without added special tokens (the
template writes BOS itself: adding another would give two), and a token is trainable when
its character span overlaps an assistant span, as transformers decides for its own masks.

:func:`assistant_spans` and :func:`mask_from_offsets` are pure; :class:`ChatEncoder` binds
them to a tokenizer. transformers is imported lazily (``hsx --help`` stays fast).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx_async.errors import ArgumentError
from hsx_async.prepare.records import Conversation

Messages = list[dict[str, str]]
Span = tuple[int, int]
# (messages, add_generation_prompt) -> rendered text
Render = Callable[[Messages, bool], str]

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class RecordError(Exception):
    """This conversation cannot become a sample; the message is the quarantine reason."""


@dataclass(frozen=True, slots=True)
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def trainable(self) -> int:
        return sum(self.loss_mask)


def has_generation_markers(template: str) -> bool:
    return _GENERATION_MARKER.search(template) is not None


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def assistant_spans(render: Render, messages: Messages) -> tuple[str, list[Span]]:
    """The whole rendering and the character span of every assistant turn in it."""
    full = render(messages, False)
    spans: list[Span] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        after = render(messages[: i + 1], False)
        if not full.startswith(after):
            raise RecordError(
                f"the template renders turn {i} differently once later turns follow, so no "
                "span of the whole text is the model's answer; give the template "
                "{% generation %} markers or pass another --chat-template"
            )
        start = _common_prefix(before, after)
        end = len(after.rstrip())
        if end <= start:
            raise RecordError(f"turn {i} (assistant) renders to no text")
        spans.append((start, end))
    return full, spans


def mask_from_offsets(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[int]:
    """1 for each token whose character span overlaps one of ``spans`` (sorted)."""
    mask = [0] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0] and end > start:
            mask[t] = 1
    return mask


def load_tokenizer(path: Path) -> Any:
    """A local Hugging Face tokenizer directory (fast tokenizer: offsets are needed)."""
    # Not at module level: `hsx prepare`'s fork server preloads this module and forks
    # every worker from it, and AutoTokenizer imports torch, which must not be loaded in
    # a process that forks (its workers then die: tests/prepare/test_pipeline.py).
    from transformers import AutoTokenizer  # noqa: PLC0415

    if not path.is_dir():
        raise ArgumentError("--tokenizer", f"{path} is not a directory holding a tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ArgumentError("--tokenizer", f"cannot load a tokenizer from {path}: {exc}") from None
    if not getattr(tok, "is_fast", False):
        raise ArgumentError("--tokenizer", f"{path} has no fast tokenizer (tokenizer.json)")
    return tok


def read_template(path: Path | None, tokenizer: Any) -> str:
    """``--chat-template FILE`` if given, else the tokenizer's own template."""
    if path is not None:
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ArgumentError("--chat-template", f"cannot read {path}: {exc.strerror}") from None
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise ArgumentError(
            "--chat-template", "the tokenizer has no chat template; pass --chat-template FILE"
        )
    return template


class ChatEncoder:
    """Renders conversations with one template and encodes them with one tokenizer."""

    def __init__(self, tokenizer: Any, template: str) -> None:
        from transformers.utils.chat_template_utils import (  # noqa: PLC0415 - see load_tokenizer
            render_jinja_template,
        )

        self._render_jinja: Any = render_jinja_template
        self.tokenizer = tokenizer
        self.template = template
        self.markers = has_generation_markers(template)
        self._backend = tokenizer.backend_tokenizer
        self._specials: dict[str, str] = dict(tokenizer.special_tokens_map)
        control = sorted(
            {t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content},
            key=len,
            reverse=True,
        )
        self._control = re.compile("|".join(map(re.escape, control))) if control else None
        self.bos_id: int | None = tokenizer.bos_token_id

    def render(self, messages: Messages, add_generation_prompt: bool) -> str:
        return str(self._render_chat(messages, add_generation_prompt, markers=False)[0])

    def _render_chat(
        self, messages: Messages, add_generation_prompt: bool, *, markers: bool
    ) -> tuple[str, list[Span]]:
        if not messages:
            return "", []
        try:
            rendered, indices = self._render_jinja(
                conversations=[messages],
                chat_template=self.template,
                return_assistant_tokens_mask=markers,
                add_generation_prompt=add_generation_prompt,
                **self._specials,
            )
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception() or bug: quarantine
            raise RecordError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        spans = [(int(a), int(b)) for a, b in indices[0]] if markers else []
        return str(rendered[0]), spans

    def check_content(self, conversation: Conversation) -> None:
        """Refuse text that would be read as a control token (template injection)."""
        if self._control is None:
            return
        for i, turn in enumerate(conversation.turns):
            if found := self._control.search(turn.content):
                raise RecordError(
                    f"turn {i} ({turn.role}) holds the control token {found.group()!r}"
                )

    def encode_text(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._backend.encode(text, add_special_tokens=False)
        return list(enc.ids), list(enc.offsets)

    def encode(self, conversation: Conversation) -> Encoded:
        """input_ids and the assistant loss mask of one conversation, or RecordError."""
        self.check_content(conversation)
        messages = conversation.messages()
        if self.markers:
            text, spans = self._render_chat(messages, False, markers=True)
            if not spans:
                raise RecordError("the template's {% generation %} blocks marked no text")
        else:
            text, spans = assistant_spans(self.render, messages)
        ids, offsets = self.encode_text(text)
        if self.bos_id is not None and ids[:2] == [self.bos_id, self.bos_id]:
            raise RecordError(
                "the rendering starts with BOS twice: the template or content adds one"
            )
        mask = mask_from_offsets(offsets, spans)
        if not any(mask):
            raise RecordError("no token of an assistant turn survived tokenization")
        return Encoded(ids, mask)

    def prompt_ids(self, messages: Messages) -> list[int]:
        """The tokens of ``messages`` plus the generation prompt: what a server is sent."""
        text, _ = self._render_chat(messages, True, markers=False)
        return self.encode_text(text)[0]
