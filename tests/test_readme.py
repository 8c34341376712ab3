"""The README's commands, run as written, so the docs cannot drift from the code.

- "Try it without a GPU" and "Training while extracting": the fenced block is run by
  bash, line for line. Where user namespaces are allowed (``unshare``) it runs in private
  network, mount and PID namespaces: its fixed ports (30000, 9464, 9470) and its
  ``/tmp/hsx-*`` and ``/dev/shm/hsx-small`` are then this test's own, whatever else runs on
  the machine, and every process it starts dies with the namespace. Elsewhere (a plain
  clone in a container, a CI runner without them) it runs on the host *relocated*: each
  fixed port replaced by a free one, each fixed directory by a private one, in the block
  and in the example configs it names (copied), and the fake server given the port it
  would take by default — the same commands, nothing skipped. ``hsx`` is found on
  ``PATH`` as after the quickstart's ``. .venv/bin/activate``.
- "A real job": the ``deploy/sglang/launch.sh`` line is run with a stand-in Python whose
  ``sglang.launch_server`` records its argv (as the launch.sh tests do).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BIN = Path(sys.executable).parent


def fenced_block(heading: str, language: str = "bash") -> str:
    """The first fenced ``language`` block after the Markdown heading ``heading``."""
    text = README.read_text()
    at = text.find(f"\n{heading}\n")
    assert at >= 0, f"README has no heading {heading!r}"
    match = re.search(rf"```{language}\n(.*?)```", text[at:], re.S)
    assert match, f"no {language} block after {heading!r}"
    return match.group(1)


def _isolation() -> list[str] | None:
    """The unshare prefix that gives the block its own 127.0.0.1, /tmp and /dev/shm."""
    unshare = shutil.which("unshare")
    if unshare is None or str(REPO).startswith("/tmp/") or str(BIN).startswith("/tmp/"):
        return None
    prefix = [unshare, "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30, check=False)
    return prefix if probe.returncode == 0 else None


# The fixed places the blocks use: in namespaces they are the test's own; on the host
# they are relocated (_relocated).
TRYOUT_PORTS = (30000, 9464, 9470)
TRYOUT_DIRS = (Path("/tmp/hsx-small"), Path("/dev/shm/hsx-small"), Path("/tmp/hsx-online"))
FAKE_SERVER_PORT = 30000  # hsx fake-server's default --port, the configs' server URL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _relocated(block: str, scratch: Path, shm: Path) -> str:
    """``block`` with every fixed place made private: ports, ``/tmp`` directories (under
    ``scratch``), the dump root (``shm``), also in the example configs it names (copied
    under ``scratch`` with the same changes); the fake server is told its port."""
    moves = {str(d): str(scratch / d.name) for d in TRYOUT_DIRS if d.parts[1] == "tmp"}
    moves |= {str(d): str(shm) for d in TRYOUT_DIRS if d.parts[1] == "dev"}
    ports = {p: _free_port() for p in TRYOUT_PORTS}
    moves |= {f"127.0.0.1:{p}": f"127.0.0.1:{q}" for p, q in ports.items()}

    def move(text: str) -> str:
        for old, new in moves.items():
            text = text.replace(old, new)
        return text

    block = move(block).replace(
        "hsx fake-server ", f"hsx fake-server --port {ports[FAKE_SERVER_PORT]} "
    )
    for name in sorted(set(re.findall(r"deploy/examples/[\w.-]+\.toml", block))):
        copy = scratch / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(move((REPO / name).read_text()))
        block = block.replace(name, str(copy))
    assert not any(str(d) in block for d in TRYOUT_DIRS), block
    return block


# What runs before the README's lines: in the namespaces, a private loopback and scratch
# mounts; then the block exactly as written, stopping at the first failing command.
STRICT = "set -euo pipefail\n"
ISOLATED = textwrap.dedent(
    """\
    python3 - <<'PY' || ip link set lo up
    import fcntl, socket, struct
    s = socket.socket()
    req = struct.pack("16sH", b"lo", 0)
    flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, req))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
    PY
    mount -t tmpfs -o size=2g tmpfs /tmp
    mount -t tmpfs -o size=512m tmpfs /dev/shm
    """
)


def _run_tryout(block: str, *, apart: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``block`` in namespaces when allowed (and ``apart``), else relocated on the host."""
    prefix = _isolation() if apart else None
    scratch = Path(tempfile.mkdtemp(prefix="hsx-readme-"))
    shm = Path("/dev/shm") / scratch.name
    if prefix is None:
        block = _relocated(block, scratch, shm)
    setup = STRICT + (ISOLATED if prefix is not None else "") + f"cd {REPO}\n"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("HSX_FAILPOINT", None)
    argv = [*(prefix or []), "bash", "-c", setup + block + "echo TRYOUT-DONE\n"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=200)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the backgrounded server, whatever happened
        proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("apart", [True, False], ids=["namespaces-if-allowed", "relocated"])
def test_readme_tryout_runs_as_written(apart: bool) -> None:
    """Issue 39: without user namespaces the test skipped, so a plain clone never ran the
    README's commands; relocated, it runs them anywhere (and here, both ways)."""
    block = fenced_block("### Try it without a GPU")
    assert "hsx samples" in block and "hsx run" in block
    if not (BIN / "hsx").exists():
        pytest.fail(f"{BIN}/hsx is missing: install the package (pip install -e .)")
    proc = _run_tryout(block, apart=apart)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "TRYOUT-DONE" in proc.stdout, out[-4000:]
    assert "wrote 500 samples" in proc.stdout
    assert re.search(r"^500 samples written, 0 quarantined", proc.stdout, re.M), out[-4000:]
    assert re.search(r"^report: \S*/hsx-small/out/report\.(png|json)", proc.stdout, re.M)
    assert re.search(r"^done:\s+500 samples", proc.stdout, re.M), out[-4000:]
    assert re.search(r"^remaining:\s+0\b", proc.stdout, re.M), out[-4000:]
    assert "Traceback" not in out


@pytest.mark.timeout(240)
def test_readme_online_job_runs_as_written() -> None:
    """Training while extracting, as written: the trainer gets every sample through hsx
    serve while hsx run extracts under a spool of ~8% of the dataset."""
    block = fenced_block("### Training while extracting")
    assert "hsx serve" in block and "LiveDataset" in block and "small-online.toml" in block
    proc = _run_tryout(block)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "TRYOUT-DONE" in proc.stdout, out[-4000:]
    assert re.search(r"^trained on 200 samples$", proc.stdout, re.M), out[-4000:]
    assert re.search(r"^200 samples written, 0 quarantined", proc.stdout, re.M), out[-4000:]
    assert "0 B of 4.0 MiB held, 200 samples deleted" in proc.stdout, out[-4000:]
    # Issue 39: the config said ~25 MiB, the README ~50, the run made 53.5: one figure.
    done = re.search(r"^done:\s+200 samples, [\d,]+ tokens, ([\d.]+) MiB$", proc.stdout, re.M)
    said = (REPO / "deploy/examples/small-online.toml").read_text()
    stated = re.search(r"the dataset is\s+#?\s*~(\d+) MiB: ([\d.]+) MiB measured", said)
    assert done is not None and stated is not None, out[-4000:]
    assert abs(float(done[1]) - float(stated[2])) < 1.0, (done[1], stated[2])
    assert f"the dataset is ~{stated[1]} MiB" in " ".join(README.read_text().split())
    assert "drafter: 200 acknowledged, 0 behind, 0 leased now" in proc.stdout, out[-4000:]
    assert "intake_paused_limit" in out, out[-4000:]  # the spool, not the disk, paused it
    assert "Traceback" not in out and "Unhandled exception" not in out


# -- the GPU launch line -------------------------------------------------------------------

FAKE_LAUNCHER = textwrap.dedent(
    """
    import json, os, sys
    with open(os.environ["HSX_TEST_CAPTURE"], "w") as fh:
        json.dump({"argv": sys.argv[1:],
                   "env": {k: v for k, v in os.environ.items() if k.startswith("HSX_")}}, fh)
    """
)


def test_readme_launch_line_matches_launch_sh(tmp_path: Path) -> None:
    block = fenced_block("## A real job")
    lines = [ln for ln in block.splitlines() if "deploy/sglang/launch.sh" in ln]
    assert len(lines) == 1, block
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(FAKE_LAUNCHER)
    capture = tmp_path / "capture.json"
    env = {
        "PATH": os.environ["PATH"],
        "HSX_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO)]),
        "HSX_TEST_CAPTURE": str(capture),
    }
    proc = subprocess.run(
        ["bash", "-c", lines[0]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(capture.read_text())["argv"]
    assert argv.count("--model-path") == 1, argv
    model = argv[argv.index("--model-path") + 1]
    assert not model.startswith("-") and model.startswith("/models/"), argv
    assert argv.count("--tp-size") == 1 and argv[argv.index("--tp-size") + 1] == "8", argv
    # The README's server must match the example job it points to.
    assert "HSX_AUX_LAYERS=2,30,58" in lines[0]
    job = (REPO / "deploy" / "examples" / "kimi-k2.5.toml").read_text()
    assert re.search(r"aux_layers\s*=\s*\[2,\s*30,\s*58\]", job)


# -- the training example ------------------------------------------------------------------


def test_readme_dataloader_example_runs(tmp_path: Path) -> None:
    """The README's DataLoader loop, over a small dataset in place of the tryout's."""
    import torch

    from tests.dataset_factory import AUX_LAYERS, write_dataset

    code = fenced_block("### Reading the dataset in PyTorch", "python")
    assert '"/tmp/hsx-small/out"' in code
    out = tmp_path / "out"
    write_dataset(out, num_samples=40, hidden_size=64)
    seen: list[dict[str, torch.Tensor]] = []
    code = code.replace('"/tmp/hsx-small/out"', repr(str(out)))
    code = code.replace("num_workers=2", "num_workers=0")  # the same loop, in this process
    code = code.replace("...  # the drafter", "seen.append(batch)  # the drafter")
    scope: dict[str, object] = {"seen": seen}
    exec(compile(code, "README.md", "exec"), scope)
    assert seen, "the loop saw no batch"
    assert getattr(scope["train"], "final_state", None) == "post_norm"  # the comment's name
    first = seen[0]
    final, aux = first["hidden_states"], first["aux_hidden_states"]
    assert final.dtype == torch.bfloat16 and final.shape[-1] == 64
    assert aux.shape[-1] == 64 * len(AUX_LAYERS)
    per_epoch = sum(len(b["lengths"]) for b in seen) / 2
    assert 0 < per_epoch < 40  # the validation share is held out


def test_quickstart_puts_hsx_on_path_before_using_it() -> None:
    """Every later README command calls a bare ``hsx``: the quickstart must activate."""
    line = fenced_block("## Quickstart").strip().splitlines()[0]
    assert ". .venv/bin/activate" in line, line
    assert line.index(". .venv/bin/activate") < line.index("hsx demo"), line


def test_readme_says_what_the_final_slot_holds_per_engine() -> None:
    """Issue 26: the README said the final state is always post-norm; a vLLM dataset's is
    pre-norm. The conversion it shows is the reader's own signature."""
    import inspect

    from hsx_async.dataset.reader import FINAL_STATES, HiddenStateDataset

    text = " ".join(README.read_text().split())
    assert "always post-norm" not in text and "final (post-norm) layer" not in text
    assert "post-norm from SGLang" in text and "pre-norm from vLLM" in text
    assert '`"post_norm"` for an SGLang-made dataset' in text
    assert '`"pre_norm"` for a vLLM-made one' in text
    shown = re.search(r"HiddenStateDataset\(\.\.\., final_state=\"(\w+)\", model=", text)
    assert shown is not None and shown[1] in FINAL_STATES
    params = inspect.signature(HiddenStateDataset).parameters
    assert {"final_state", "model"} <= set(params)


def test_the_aux_layer_table_is_sglangs_default_and_its_draft_ids() -> None:
    """Issue 39: nothing said how to choose the aux layers for one's own model. The
    README's table is SGLang's default for each n, and the drafter ids it quotes are the
    ones hsx prints (hsx_async.layer_ids)."""
    from hsx_async.layer_ids import default_capture, draft_ids

    text = README.read_text()
    section = text[text.index("### Choosing the aux layers") :]
    section = section[: section.index("\n## ")]
    rows = re.findall(r"^\| ([^|]+) \| (\d+) \| `([\d,]+)` \|$", section, re.M)
    assert len(rows) == 3, section
    for _, n, layers in rows:
        assert tuple(map(int, layers.split(","))) == default_capture(int(n))
    assert "HSX_AUX_LAYERS=2,30,58" in text  # the Kimi example: its row
    llama = draft_ids("LlamaForCausalLM", (2, 16, 29), 32).ids
    kimi = draft_ids("KimiK25ForConditionalGeneration", (2, 30, 58), 61).ids
    flat = " ".join(section.split())
    assert f"Llama's `2,16,29` is `{list(llama or ())}` there" in flat
    assert f"Kimi's `2,30,58` is `{list(kimi or ())}`" in flat


def test_the_configuration_says_what_the_direct_copy_does() -> None:
    """Issue 39: "direct (O_DIRECT from mmap)" contradicted "no part is ever mapped"; the
    writer reads each part into a buffer and writes it with O_DIRECT (run/dumps/writer.py)."""
    text = README.read_text()
    assert "from mmap" not in text
    assert "direct (read into a buffer, written O_DIRECT)" in text
