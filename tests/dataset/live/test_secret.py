"""The shared secret of ``hsx serve`` and its readers: where it is read from (a file given,
``HSX_SERVE_SECRET_FILE``, ``HSX_SERVE_SECRET``), and what is refused (a file others may
read, a short or blank secret, a missing file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsx_async.dataset.live.secret import ca_file, read_secret
from hsx_async.errors import DatasetError

SECRET = "0123456789abcdef0123"


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HSX_SERVE_SECRET_FILE", "HSX_SERVE_SECRET", "HSX_SERVE_CA_FILE"):
        monkeypatch.delenv(name, raising=False)


def _file(tmp_path: Path, text: str, mode: int = 0o600, name: str = "s") -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_file_given_then_the_file_in_the_environment_then_the_secret_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert read_secret(None, name="--secret-file") is None
    monkeypatch.setenv("HSX_SERVE_SECRET", "e" * 20)
    assert read_secret(None, name="--secret-file") == b"e" * 20
    monkeypatch.setenv("HSX_SERVE_SECRET_FILE", str(_file(tmp_path, "f" * 20 + "\n", name="env")))
    assert read_secret(None, name="--secret-file") == b"f" * 20
    assert read_secret(_file(tmp_path, f"  {SECRET}\n"), name="--secret-file") == SECRET.encode()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o660, 0o644])
def test_a_file_its_group_or_others_may_open_is_refused(tmp_path: Path, mode: int) -> None:
    path = _file(tmp_path, SECRET, mode)
    with pytest.raises(DatasetError, match=f"open to its group or others.*chmod 600 {path}"):
        read_secret(path, name="--secret-file")
    assert read_secret(_file(tmp_path, SECRET, 0o400, "ro"), name="x") == SECRET.encode()


@pytest.mark.parametrize("text", ["", "short", "x" * 15, "two words here, long enough", "é" * 20])
def test_a_short_or_blank_or_spaced_secret_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    with pytest.raises(DatasetError, match="at least 16"):
        read_secret(_file(tmp_path, text), name="--secret-file")
    if text:
        monkeypatch.setenv("HSX_SERVE_SECRET", text)
        with pytest.raises(DatasetError, match="HSX_SERVE_SECRET: the secret must be"):
            read_secret(None, name="--secret-file")


def test_a_missing_file_or_a_directory_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(DatasetError, match=r"--secret-file .*nope: No such file"):
        read_secret(tmp_path / "nope", name="--secret-file")
    monkeypatch.setenv("HSX_SERVE_SECRET_FILE", str(tmp_path))
    with pytest.raises(DatasetError, match=r"HSX_SERVE_SECRET_FILE .* not a regular file"):
        read_secret(None, name="--secret-file")


def test_the_ca_file_given_or_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ca_file(None) is None
    monkeypatch.setenv("HSX_SERVE_CA_FILE", "/etc/ca.pem")
    assert ca_file(None) == Path("/etc/ca.pem")
    assert ca_file(tmp_path / "mine.pem") == tmp_path / "mine.pem"
