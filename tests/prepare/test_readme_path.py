"""The README's "From conversations to a training set" path, run as written: conversations
→ hsx regenerate → hsx prepare → hsx run → hsx export, on the CPU, against the reference
server serving the tiny Llama.

The test starts the server itself (in process, on a free port, in its own /dev/shm root)
instead of the README's background line, and gives ``hsx run`` no metrics port; it
substitutes only those in the README's text, and checks the first block is what it does.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
from pathlib import Path

import orjson
import pytest
import torch

from hsx_async.dataset.manifest import read_manifest
from hsx_async.server.reference.model import save_default_model
from hsx_async.server.reference.server import ReferenceOptions, running_reference_server

REPO = Path(__file__).resolve().parents[2]
SECTION = "## From conversations to a training set"
pytestmark = pytest.mark.timeout(240)


def readme_blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)


def test_the_first_block_is_what_the_test_does() -> None:
    setup, _ = readme_blocks()
    assert 'save_default_model(Path("tiny-llama"))' in setup
    assert (
        "hsx reference-server --model tiny-llama --port 30000 --dump-root /dev/shm/hsx-conv"
        in setup
    )


async def test_readme_path_runs_end_to_end(tmp_path: Path, shm_root: Path) -> None:
    _, path_block = readme_blocks()
    (tmp_path / "deploy" / "examples").mkdir(parents=True)
    conversations = REPO / "deploy" / "examples" / "tiny-conversations.jsonl"
    shutil.copy(conversations, tmp_path / "deploy" / "examples")
    model_dir = await asyncio.to_thread(save_default_model, tmp_path / "tiny-llama")
    options = ReferenceOptions(model=str(model_dir), dump_root=shm_root, aux_layers=(1, 3, 5))
    async with running_reference_server(options) as server:
        script = (
            path_block.replace("http://127.0.0.1:30000", server.url)
            .replace("/dev/shm/hsx-conv", str(shm_root))
            .replace("[regenerate]", '[daemon]\nmetrics_listen = ""\n[regenerate]')
            .replace(".venv/bin/", "")
        )
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        env.pop("HSX_FAILPOINT", None)
        proc = await asyncio.create_subprocess_exec(
            "bash", "-euo", "pipefail", "-c", script, cwd=tmp_path, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        async with asyncio.timeout(200):
            output, _ = await proc.communicate()
        assert proc.returncode == 0, output.decode(errors="replace")[-4000:]

    source = conversations.read_bytes().splitlines()
    regen = [orjson.loads(x) for x in (tmp_path / "regen.jsonl").read_bytes().splitlines()]
    regen_q = (tmp_path / "regen.quarantine.jsonl").read_bytes().splitlines()
    assert len(regen) + len(regen_q) == len(source) and len(regen_q) == 2
    samples = {
        s["id"]: s
        for s in map(orjson.loads, (tmp_path / "samples.jsonl").read_bytes().splitlines())
    }
    assert set(samples) == {r["id"] for r in regen}
    summary = orjson.loads((tmp_path / "samples.summary.json").read_bytes())
    assert summary["samples"] == len(samples) and "extraction_estimate" in summary
    manifest = read_manifest(tmp_path / "hsx-out")
    assert {e.id for e in manifest} == set(samples)
    # The exported training files carry each sample's ids and mask unchanged.
    exported = list((tmp_path / "specforge-data").rglob("*.ckpt"))
    assert len(exported) == len(samples)
    seen = set()
    for path in exported:
        data = torch.load(path, weights_only=True)
        ids = data["input_ids"].flatten().tolist()
        match = [s for s in samples.values() if s["input_ids"] == ids]
        assert match, f"{path} holds no prepared sample"
        assert data["loss_mask"].flatten().tolist() == match[0]["loss_mask"]
        seen.add(match[0]["id"])
    assert seen == set(samples)
