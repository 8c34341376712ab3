"""The hook refuses a real SGLang server started without ``--disable-radix-cache``: the
server exits during start-up, saying which flag to add, and serves nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.real_sglang.conftest import (
    CPU_FLAGS,
    LAUNCH,
    launch_env,
    new_dump_root,
    running,
    server_port,
    wait_exit,
)

pytestmark = [pytest.mark.real_sglang, pytest.mark.timeout(400)]

RADIX_FLAG = "    --disable-radix-cache \\\n"


def test_server_without_disable_radix_cache_is_refused(
    tmp_path: Path, sglang_py: Path, model_dir: Path
) -> None:
    # launch.sh always passes the flag: run the project's script with only that line gone.
    script = LAUNCH.read_text()
    assert script.count(RADIX_FLAG) == 1
    launch = tmp_path / "launch-with-radix-cache.sh"
    launch.write_text(script.replace(RADIX_FLAG, ""))
    env = launch_env(sglang_py, new_dump_root(), server_port())
    command = ["bash", str(launch), str(model_dir), *CPU_FLAGS]
    with running(command, env, tmp_path / "sglang.log") as server:
        code = wait_exit(server)
        log = server.log_text()
        dumps = sorted(server.dump_root.iterdir())
    assert code != 0, log[-3000:]
    assert "--disable-radix-cache" in log, log[-3000:]
    assert "hsx hook installed" not in log
    assert "The server is fired up and ready to roll" not in log
    assert dumps == []
