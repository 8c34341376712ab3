"""deploy/slurm/hsx-array.sbatch on a real single-node Slurm, as a 2-task array.

Debian's slurmctld, slurmd and munge (``bash .ci/ops-env``) run from a ``slurm.conf``
written here (the node is this host, everything on 127.0.0.1, state in a temp dir). The
script runs unmodified with ``HSX_SERVER=fake`` (each task starts ``hsx fake-server``) and
resources overridden on the sbatch command line; each task writes its shard to its own
directory (``${SLURM_ARRAY_TASK_ID}`` in ``output.dir``, as node-local disks would), and
``hsx merge`` of the two must equal one unsharded run. Everything is stopped at the end.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hsx_async.dataset.manifest import read_manifest, read_quarantine
from tests.deploy.realenv import process, require_tools, wait_for
from tests.e2e import (
    check_dataset,
    config_raw,
    free_port,
    shm_leftovers,
    write_config,
    write_samples,
)

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "hsx-array.sbatch"
TOOLS = ("slurmctld", "slurmd", "sbatch", "sinfo", "scancel", "munged", "runuser")
H, AUX = 64, (1, 3, 5)


@dataclass
class Cluster:
    conf: Path
    env: dict[str, str]  # what a client (sbatch, sinfo) needs: SLURM_CONF
    tmp: Path

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def node_state(self) -> str | None:
        out = self.run("sinfo", "-h", "-o", "%T").stdout.strip()
        return out or None


def _root_or_skip() -> None:
    if os.geteuid() != 0:
        message = "a single-node Slurm needs root (slurmd runs jobs, munged runs as munge)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@contextlib.contextmanager
def _munge_dir() -> Iterator[Path]:
    """A private munged socket: munged runs as user munge, and refuses a socket in a
    directory others cannot traverse."""
    base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    d = Path(tempfile.mkdtemp(prefix="hsx-munge-", dir=base))
    munge = pwd.getpwnam("munge")
    os.chown(d, munge.pw_uid, munge.pw_gid)
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _slurm_conf(tmp: Path, munge_socket: Path) -> Path:
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout
    host = host.strip()
    # This machine's own figures (slurmd -C), so that the node is never drained as smaller
    # than configured.
    probed = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True)
    node = next(line for line in probed.stdout.splitlines() if line.startswith("NodeName="))
    for d in ("state", "spool"):
        (tmp / d).mkdir()
    conf = tmp / "slurm.conf"
    conf.write_text(
        f"""\
ClusterName=hsxtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MailProg=/bin/true
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
SlurmUser=root
SlurmdUser=root
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
ReturnToService=2
JobCompType=jobcomp/none
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=hsx Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
    )
    return conf


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    require_tools(*TOOLS)
    _root_or_skip()
    # Not pytest's tmp_path: slurmd and munged (another user) need a path they can reach.
    with contextlib.ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="hsx-slurm-"))
        stack.callback(shutil.rmtree, tmp, True)
        munge = stack.enter_context(_munge_dir())
        socket = munge / "munge.socket"
        munged = [
            "runuser", "-u", "munge", "--", "munged", "-F", f"--socket={socket}",
            f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
            f"--seed-file={munge}/munged.seed",
        ]  # fmt: skip
        stack.enter_context(process(munged, tmp / "munged.out"))
        wait_for("munged's socket", lambda: socket.exists() or None, 20)
        conf = _slurm_conf(tmp, socket)
        env = {**os.environ, "SLURM_CONF": str(conf)}
        c = Cluster(conf, env, tmp)
        # slurmctld first (closed last); scancel whatever a failed test left running.
        stack.enter_context(process(["slurmctld", "-D", "-f", str(conf)], tmp / "ctld.out", env))
        stack.callback(lambda: c.run("scancel", "--full", "--user=root"))
        stack.enter_context(process(["slurmd", "-D", "-f", str(conf)], tmp / "slurmd.out", env))
        stack.callback(lambda: c.run("scancel", "--full", "--user=root"))
        state = wait_for("the node to be idle", lambda: c.node_state() == "idle" or None, 60)
        assert state
        yield c


def _hsx_wrapper(tmp: Path) -> Path:
    """``hsx`` for the job: this interpreter, this checkout."""
    path = tmp / "hsx"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hsx_async "$@"\n')
    path.chmod(0o755)
    return path


@pytest.mark.timeout(300)  # sbatch --wait polls: ~10 s a step at least
def test_two_task_array_equals_one_unsharded_run(cluster: Cluster, shm_root: Path) -> None:
    tmp = cluster.tmp
    samples = write_samples(tmp / "in.jsonl", 60, max_len=24, bad_every=9, with_duplicates=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # No [shard]: each task takes SLURM_ARRAY_TASK_ID of SLURM_ARRAY_TASK_COUNT.
    raw = config_raw(tmp, samples.path, [url], shm_root)
    raw["output"]["dir"] = str(tmp / "node-${SLURM_ARRAY_TASK_ID}")
    write_config(tmp, raw)
    hsx = _hsx_wrapper(tmp)
    env = {
        **cluster.env,
        "HSX_SERVER": "fake",
        "HSX_CONFIG": str(tmp / "hsx.toml"),
        "HSX_BIN": str(hsx),
        "HSX_PORT": str(port),
        "HSX_DUMP_ROOT": str(shm_root),
        "HSX_AUX_LAYERS": ",".join(map(str, AUX)),
        "HSX_FAKE_SERVER_ARGS": f"--hidden-size {H}",
        "HSX_POLL_INTERVAL": "0.5",
    }
    submit = [
        "sbatch", "--wait", "--array=0-1", "--gpus-per-node=0", "--cpus-per-task=1",
        "--mem=1G", "--time=10", f"--output={tmp}/hsx-%A_%a.log", str(SBATCH),
    ]  # fmt: skip
    done = subprocess.run(
        submit, env=env, cwd=tmp, capture_output=True, text=True, timeout=240, check=False
    )
    logs = "\n".join(p.read_text() for p in sorted(tmp.glob("hsx-*.log")))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{logs}"
    assert len(list(tmp.glob("hsx-*_*.log"))) == 2, logs
    assert "starting the fake server" in logs and "hsx exited with status 0" in logs

    shards = [tmp / f"node-{i}" for i in range(2)]
    for i, shard in enumerate(shards):
        assert list(shard.glob("manifest*.jsonl")) == [
            shard / f"manifest.shard-{i:05d}-of-00002.jsonl"
        ], logs
    # One unsharded run of the same input, to compare with.
    single = _unsharded_run(tmp, samples.path, shm_root)
    merged = tmp / "merged"
    merge = [str(hsx), "merge", *map(str, shards), "--to", str(merged)]
    subprocess.run(merge, check=True, timeout=120, capture_output=True)
    assert {(e.id, e.xxh3_64) for e in read_manifest(merged)} == {
        (e.id, e.xxh3_64) for e in read_manifest(single)
    }
    sharded_q = {(q.id, q.line) for s in shards for q in read_quarantine(s)}
    assert sharded_q == {(q.id, q.line) for q in read_quarantine(single)}
    assert sharded_q, "the input's bad lines should be quarantined"
    check_dataset(merged, samples, hidden_size=H, num_layers=len(AUX) + 1)
    assert shm_leftovers(shm_root) == []


def _unsharded_run(tmp: Path, samples: Path, shm_root: Path) -> Path:
    port = free_port()
    raw = config_raw(tmp, samples, [f"http://127.0.0.1:{port}"], shm_root)
    raw["output"]["dir"] = str(tmp / "single")
    raw["shard"] = {"index": 0, "count": 1}
    write_config(tmp, raw, "single.toml")
    server = [
        sys.executable, "-m", "hsx_async", "fake-server", "--port", str(port),
        "--hidden-size", str(H), "--aux-layers", ",".join(map(str, AUX)),
        "--dump-root", str(shm_root),
    ]  # fmt: skip
    with process(server, tmp / "single-server.log"):
        run = subprocess.run(
            [sys.executable, "-m", "hsx_async", "run", "--config", str(tmp / "single.toml")],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert run.returncode == 0, run.stdout + run.stderr
    return tmp / "single"
