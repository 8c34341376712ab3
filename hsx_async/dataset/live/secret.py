"""The shared secret of ``hsx serve`` and its readers: who may lease, download and
acknowledge (README, threat model).

Read from a file (``--secret-file``, ``secret_file=``, or ``HSX_SERVE_SECRET_FILE``) or from
``HSX_SERVE_SECRET`` itself; never from a command line (other users see it in ``ps``). A
file that its group or other users may read is refused, as ssh refuses such a key. The
secret travels as ``Authorization: Bearer <secret>`` (what Prometheus sends from its
``credentials_file``), so it is visible ASCII, at least :data:`MIN_LENGTH` characters.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from hsx_async.errors import DatasetError

SECRET_FILE_ENV = "HSX_SERVE_SECRET_FILE"
SECRET_ENV = "HSX_SERVE_SECRET"
CA_FILE_ENV = "HSX_SERVE_CA_FILE"
MIN_LENGTH = 16
MAX_LENGTH = 4096
_VISIBLE = re.compile(rb"[\x21-\x7e]+")
MAKE_ONE = "e.g. openssl rand -hex 32 > FILE; chmod 600 FILE"


def read_secret(path: str | Path | None, *, name: str) -> bytes | None:
    """The secret from ``path`` (given as ``name``: ``--secret-file``, ``secret_file=``),
    else from the file ``HSX_SERVE_SECRET_FILE`` names, else ``HSX_SERVE_SECRET``; None
    when none of them is set."""
    if path is not None and str(path):
        return _from_file(Path(path), name)
    if os.environ.get(SECRET_FILE_ENV):
        return _from_file(Path(os.environ[SECRET_FILE_ENV]), SECRET_FILE_ENV)
    if os.environ.get(SECRET_ENV):
        return _checked(os.environ[SECRET_ENV].encode("utf-8", "replace").strip(), SECRET_ENV)
    return None


def _from_file(path: Path, name: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise DatasetError(f"{name} {path}: {exc.strerror}; give the file of the secret") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DatasetError(f"{name} {path} is not a regular file; give the file of the secret")
        if st.st_mode & 0o077:
            raise DatasetError(
                f"{name} {path} is open to its group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): run chmod 600 {path}"
            )
        raw = os.read(fd, MAX_LENGTH + 2)
    finally:
        os.close(fd)
    return _checked(raw.strip(), f"{name} {path}")


def _checked(secret: bytes, where: str) -> bytes:
    if len(secret) < MIN_LENGTH or len(secret) > MAX_LENGTH or not _VISIBLE.fullmatch(secret):
        raise DatasetError(
            f"{where}: the secret must be at least {MIN_LENGTH} (at most {MAX_LENGTH}) visible "
            f"ASCII characters, no spaces ({MAKE_ONE})"
        )
    return secret


def ca_file(path: str | Path | None) -> Path | None:
    """The CA file a reader trusts for ``https://`` (``ca_file=``, else
    ``HSX_SERVE_CA_FILE``); None: the system's store."""
    given = str(path) if path is not None and str(path) else os.environ.get(CA_FILE_ENV, "")
    return Path(given) if given else None
