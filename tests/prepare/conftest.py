"""Fixtures of the prepare/regenerate tests: local tokenizers with real chat-template styles
(built once per session) and the tiny reference model saved with a chat template."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import orjson
import pytest

from tests.prepare.chat_styles import STYLES, build_tokenizer

# The tiny model's tokenizer is word-level over t0..t1020 (ids 3..1023): its template uses
# words of that vocabulary as role headers and </s> (id 1) as the end of turn.
TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %} t1000 {{ m.content }}"
    "{% elif m.role == 'user' %} t1001 {{ m.content }}"
    "{% else %} t1002 {{ m.content }} </s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} t1002{% endif %}"
)
TINY_SEED = 0


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tokenizers")
    return {name: build_tokenizer(style, base / name) for name, style in STYLES.items()}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference server's built-in model as a local HF dir, with TINY_TEMPLATE."""
    from transformers import AutoTokenizer

    from hsx_async.server.reference.model import save_default_model

    path = save_default_model(tmp_path_factory.mktemp("tiny") / "model", TINY_SEED)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tok.chat_template = TINY_TEMPLATE
    tok.save_pretrained(str(path))
    return path


WriteLines = Callable[[Path, Sequence[object]], Path]


@pytest.fixture
def write_jsonl() -> WriteLines:
    def write(path: Path, records: Sequence[object]) -> Path:
        lines = [r if isinstance(r, bytes) else orjson.dumps(r) for r in records]
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        return path

    return write


def tiny_conversation(i: int, turns: int = 2) -> dict[str, object]:
    """A conversation in the tiny vocabulary: ``turns`` user/assistant exchanges."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "t7 t8"}]
    for k in range(turns):
        words = " ".join(f"t{(i * 31 + k * 7 + j) % 900 + 10}" for j in range(3 + k))
        messages.append({"role": "user", "content": words})
        messages.append({"role": "assistant", "content": f"t{i % 50 + 20} t{k + 5}"})
    return {"id": f"conv-{i}", "messages": messages}
