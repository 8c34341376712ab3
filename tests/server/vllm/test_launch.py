"""deploy/vllm/launch.sh: what it refuses before vLLM starts, and the command it runs
(with a stand-in Python that records vLLM's command line instead of starting it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
LAUNCH = REPO / "deploy" / "vllm" / "launch.sh"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 61}))
    return d


@pytest.fixture
def python(tmp_path: Path) -> Path:
    """Runs the layer check with the real interpreter; records `-m vllm...` calls."""
    record = tmp_path / "argv.json"
    stand_in = tmp_path / "python"
    stand_in.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "if sys.argv[1] == '-m':\n"
        f"    open({str(record)!r}, 'w').write(json.dumps({{'argv': sys.argv[1:],"
        " 'root': os.environ.get('HSX_DUMP_ROOT')}))\n"
        "    sys.exit(0)\n"
        f"os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
    )
    stand_in.chmod(0o755)
    return stand_in


def launch(python: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "HSX_PYTHON": str(python), **env}
    for key in ("HSX_AUX_LAYERS", "HSX_DUMP_ROOT"):
        if key not in env:
            full.pop(key, None)
    return subprocess.run(["bash", str(LAUNCH), *args], env=full, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


def test_runs_vllm_with_every_flag_hsx_needs(python: Path, model_dir: Path) -> None:
    out = launch(python, str(model_dir), "--max-model-len", "4096", HSX_AUX_LAYERS="2,30,58")
    assert out.returncode == 0, out.stderr
    rec = json.loads((python.parent / "argv.json").read_text())
    argv = rec["argv"]
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--no-enable-prefix-caching" in argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2, 30, 58, 61,
    ]  # fmt: skip
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "HsxHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "hsx_async.server.vllm.connector"
    assert argv[-2:] == ["--max-model-len", "4096"]
    assert rec["root"] == "/dev/shm/hsx"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "set HSX_AUX_LAYERS"),
        ({"HSX_AUX_LAYERS": "30,2,58"}, "not strictly ascending"),
        ({"HSX_AUX_LAYERS": "2,x"}, "not a comma-separated list"),
        ({"HSX_AUX_LAYERS": "2,30,61"}, "does not fit a model with 61 layers"),
        ({"HSX_AUX_LAYERS": "2,30", "HSX_DUMP_ROOT": "shm/hsx"}, "is relative"),
    ],
)
def test_refuses_before_starting_vllm(
    python: Path, model_dir: Path, env: dict[str, str], message: str
) -> None:
    out = launch(python, str(model_dir), **env)
    assert out.returncode == 2 and message in out.stderr
    assert not (python.parent / "argv.json").exists()


def test_usage(python: Path) -> None:
    out = launch(python)
    assert out.returncode == 2 and "usage:" in out.stderr
