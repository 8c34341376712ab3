"""The tier's environment rule, without the environment: a missing SGLang Python skips
with the command that builds it, and fails instead when ``CI`` is set."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.real_sglang.conftest import sglang_python


def test_missing_environment_skips_outside_ci_and_fails_in_ci(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HSX_SGLANG_PYTHON", str(tmp_path / "no-such-python"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"bash \.ci/sglang-env"):
        sglang_python()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"bash \.ci/sglang-env"):
        sglang_python()


def test_named_environment_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setenv("HSX_SGLANG_PYTHON", str(python))
    assert sglang_python() == python


def test_the_release_under_test_is_read_from_the_environment(tmp_path: Path) -> None:
    """``HSX_SGLANG_PYTHON`` names 0.5.23's or 0.5.14's environment: the tier's version
    checks take the release from that environment's dist-info, without starting it."""
    from tests.real_sglang.conftest import sglang_release

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    assert sglang_release(python) is None
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "sglang-0.5.14.dist-info").mkdir(parents=True)
    assert sglang_release(python) == "0.5.14"
