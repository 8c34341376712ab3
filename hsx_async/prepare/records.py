"""Conversation records: ShareGPT and OpenAI-style JSONL lines, checked and normalised. Pure.

Two shapes are read, one per line:

* ShareGPT: ``{"id": ..., "conversations": [{"from": "human", "value": "..."}, ...]}``
* OpenAI: ``{"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}``

Both become a :class:`Conversation` of ``(role, content)`` turns with roles ``system``,
``user`` and ``assistant``. A record that cannot be one (bad JSON, unknown role, empty or
non-string content, no assistant turn, ...) is a :class:`BadRecord` with the reason, never
dropped. The id is the record's ``id`` (string or integer) when it has one, else derived
from the content, so the same conversation gets the same id in every run and tool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import xxhash

Role = Literal["system", "user", "assistant"]
SourceFormat = Literal["sharegpt", "openai"]
SystemPolicy = Literal["keep", "drop", "override"]

# ShareGPT's "from" values seen in public dumps, and OpenAI's roles.
_ROLE_NAMES: dict[str, Role] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
_MAX_ID_CHARS = 200
DERIVED_ID_PREFIX = "c-"


@dataclass(frozen=True, slots=True)
class Turn:
    role: Role
    content: str


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str | int
    line: int
    turns: tuple[Turn, ...]
    source_format: SourceFormat

    def messages(self) -> list[dict[str, str]]:
        """The turns as chat-template messages."""
        return [{"role": t.role, "content": t.content} for t in self.turns]

    @property
    def assistant_turns(self) -> int:
        return sum(t.role == "assistant" for t in self.turns)


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A line that goes to quarantine; ``id`` is None when the line gives no usable id."""

    line: int
    id: str | int | None
    reason: str


Record = Conversation | BadRecord


def derived_id(turns: Sequence[Turn]) -> str:
    """A stable id from the content: XXH3-64 of the canonical turns."""
    canonical = orjson.dumps([[t.role, t.content] for t in turns])
    return DERIVED_ID_PREFIX + xxhash.xxh3_64_hexdigest(canonical)


def _given_id(obj: dict[str, Any]) -> tuple[str | int | None, str]:
    """(id, "") for a usable ``id``, (None, "") when absent, (None, reason) when unusable."""
    if "id" not in obj or obj["id"] is None:
        return None, ""
    value = obj["id"]
    if type(value) is int and value >= 0:
        return value, ""
    if isinstance(value, str) and 0 < len(value) <= _MAX_ID_CHARS and value.isprintable():
        return value, ""
    return None, f"id {str(value)[:60]!r} is not a non-negative integer or a printable string"


def _turns(obj: dict[str, Any]) -> tuple[list[Any], str, str, SourceFormat] | str:
    """(turns, role key, content key, format) of a record, or why it has none."""
    has_conv, has_msgs = "conversations" in obj, "messages" in obj
    if has_conv and has_msgs:
        return "record has both 'conversations' and 'messages'; keep one"
    if not (has_conv or has_msgs):
        return "record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI)"
    name = "conversations" if has_conv else "messages"
    raw = obj[name]
    if not isinstance(raw, list) or not raw:
        return f"'{name}' is not a non-empty list"
    if has_conv:
        return raw, "from", "value", "sharegpt"
    return raw, "role", "content", "openai"


def _turn(raw: object, index: int, role_key: str, content_key: str) -> Turn | str:
    if not isinstance(raw, dict):
        return f"turn {index} is not an object"
    name = raw.get(role_key)
    role = _ROLE_NAMES.get(name.lower()) if isinstance(name, str) else None
    if role is None:
        return f"turn {index} has unknown {role_key} {str(name)[:40]!r}"
    content = raw.get(content_key)
    if not isinstance(content, str):
        kind = "missing" if content is None else type(content).__name__
        return f"turn {index} ({role}) content is {kind}, expected a string"
    if not content.strip():
        return f"turn {index} ({role}) has empty content"
    if "\x00" in content:
        return f"turn {index} ({role}) content holds a NUL character"
    return Turn(role, content)


def apply_system(turns: list[Turn], policy: SystemPolicy, prompt: str | None) -> list[Turn]:
    """System prompt handling: ``keep`` the record's (adding ``prompt`` when it has none),
    ``drop`` every system turn, or ``override`` with ``prompt`` (dropped when None)."""
    if policy == "keep":
        has_system = any(t.role == "system" for t in turns)
        return turns if has_system or prompt is None else [Turn("system", prompt), *turns]
    rest = [t for t in turns if t.role != "system"]
    if policy == "override" and prompt is not None:
        return [Turn("system", prompt), *rest]
    return rest


def parse_record(
    raw: bytes,
    line: int,
    *,
    system: SystemPolicy = "keep",
    system_prompt: str | None = None,
) -> Record:
    """One JSONL line as a :class:`Conversation`, or a :class:`BadRecord` saying why not."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return BadRecord(line, None, f"not JSON: {exc}")
    if not isinstance(obj, dict):
        return BadRecord(line, None, f"a JSON {type(obj).__name__}, expected an object")
    given, id_problem = _given_id(obj)
    if id_problem:
        return BadRecord(line, None, id_problem)
    shape = _turns(obj)
    if isinstance(shape, str):
        return BadRecord(line, given, shape)
    raw_turns, role_key, content_key, fmt = shape
    turns: list[Turn] = []
    for index, item in enumerate(raw_turns):
        turn = _turn(item, index, role_key, content_key)
        if isinstance(turn, str):
            return BadRecord(line, given, turn)
        turns.append(turn)
    turns = apply_system(turns, system, system_prompt)
    if not any(t.role == "assistant" for t in turns):
        return BadRecord(line, given, "no assistant turn: nothing to train on")
    if turns[0].role == "assistant":
        return BadRecord(line, given, "the first turn is the assistant's: no prompt precedes it")
    sample_id = given if given is not None else derived_id(turns)
    return Conversation(sample_id, line, tuple(turns), fmt)
