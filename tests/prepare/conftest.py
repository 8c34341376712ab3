"""Fixtures of the prepare/regenerate tests: local tokenizers with real chat-template styles
(built once per session) and the tiny reference model saved with a chat template."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import orjson
import pytest

from tests.prepare.chat_styles import STYLES, build_tokenizer

TINY_SEED = 0


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tokenizers")
    return {name: build_tokenizer(style, base / name) for name, style in STYLES.items()}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference server's built-in model as a local HF dir (with its chat template)."""
    from hsx_async.server.reference.model import save_default_model

    return save_default_model(tmp_path_factory.mktemp("tiny") / "model", TINY_SEED)


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
