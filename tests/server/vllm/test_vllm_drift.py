"""Drift guard for the vLLM connector: the installed vLLM's source (the real-vLLM tier's
``.venv-vllm``, built by ``bash .ci/vllm-env``) has every name :data:`VLLM_TARGETS` lists,
read as text, and a renamed one is named. ``.ci/engine-drift`` runs the same check on every
release of the stated range. Skips without the environment, except under CI."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from hsx_async.server.drift import Target, check_targets
from hsx_async.server.engine_versions import ENGINE_RANGES
from hsx_async.server.vllm.drift import VLLM_TARGETS, release_problems
from tests.real_vllm.conftest import VLLM_PYTHON


def _tier_source() -> tuple[Path, str] | tuple[None, None]:
    for site in sorted(VLLM_PYTHON.parent.parent.glob("lib/python3*/site-packages")):
        dists = sorted(site.glob("vllm*.dist-info"))
        if (site / "vllm").is_dir() and dists:
            return site / "vllm", dists[0].name.removesuffix(".dist-info").split("-")[1]
    return None, None


ROOT, VERSION = _tier_source()
pytestmark = pytest.mark.skipif(
    ROOT is None and not os.environ.get("CI"),
    reason="no vllm source: build the real-vLLM environment with `bash .ci/vllm-env`",
)


def vllm_root() -> Path:
    assert ROOT is not None, "no vllm source (bash .ci/vllm-env builds .venv-vllm)"
    return ROOT


def test_installed_vllm_is_in_the_range() -> None:
    assert VERSION is not None and ENGINE_RANGES["vllm"].accepts(VERSION)


def test_every_target_is_in_the_installed_source() -> None:
    problems = release_problems(vllm_root())
    assert problems == [], "vLLM moved what the hsx connector relies on:\n" + "\n".join(problems)


@pytest.mark.parametrize("target", VLLM_TARGETS, ids=lambda t: f"{t.label}@{t.path}")
def test_a_renamed_target_is_named(tmp_path: Path, target: Target) -> None:
    text = (vllm_root() / target.path).read_text(encoding="utf-8")
    names = target.params if target.kind == "calls" else (target.name,)
    for name in names:
        pattern = rf"(?<!\w){re.escape(name)}(?!\w)"
        assert re.search(pattern, text), f"{name!r} not found in {target.path}"
        text = re.sub(pattern, name + "_moved", text)
    dest = tmp_path / "vllm" / target.path
    dest.parent.mkdir(parents=True)
    dest.write_text(text, encoding="utf-8")
    problems = check_targets(tmp_path / "vllm", [target])
    assert len(problems) == 1 and problems[0].startswith(f"{target.label} ({target.path}): ")
    assert target.why in problems[0]
