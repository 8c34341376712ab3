"""deploy/sglang/README.md names, under "Covered models", every model family this tier
serves through real SGLang (and Kimi-K2.5, the README's headline job, whose architecture
the tiny DeepSeek-V3 is), so what the docs call covered is what CI proves. No SGLang
needed: it reads the README and the tier's own model definitions."""

from __future__ import annotations

import re

from hsx_async.server.reference.model import build_default_model
from tests.real_sglang import tiny_deepseek
from tests.real_sglang.conftest import REPO

README = REPO / "deploy" / "sglang" / "README.md"


def covered_section() -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"^## Covered models.*?(?=^## )", text, flags=re.M | re.S)
    assert match, f"{README} has no '## Covered models' section"
    return match[0]


def test_every_architecture_the_tier_serves_is_named_as_covered() -> None:
    section = covered_section()
    served = [
        type(build_default_model()).__name__,  # the tiny Llama
        tiny_deepseek.ARCHITECTURE,
        tiny_deepseek.KIMI_ARCHITECTURE,  # its layer ids are probed through SGLang's class
    ]
    missing = [arch for arch in served if f"`{arch}`" not in section]
    assert not missing, f"{README} does not name {missing} under 'Covered models'"
    for name in ("Kimi-K2.5", "DeepSeek-V3", "Llama"):
        assert name in section
    assert "tests/real_sglang/test_real_deepseek.py" in section
