"""The deployment files under deploy/, the Dockerfile and .ci/check-deploy.

They are configuration that only fails on a cluster, so each is checked here for what it
must say (the Job is Indexed, both containers share a memory-backed /dev/shm, the unit
waits longer than hsx drains, ...) and for agreement with the others and with hsx's config
schema. External validators run when installed and are skipped, with the reason, if not.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
UNIT = DEPLOY / "systemd" / "hsx.service"
SBATCH = DEPLOY / "slurm" / "hsx-array.sbatch"
EXAMPLES = sorted((DEPLOY / "examples").glob("*.toml"))
SHELL_SCRIPTS = sorted(
    [
        *DEPLOY.rglob("*.sh"),
        *DEPLOY.rglob("*.sbatch"),
        REPO / ".ci" / "check-deploy",
        REPO / ".ci" / "ops-env",
    ]
)
# [daemon].drain_timeout's default, when hsx_async.config is not there to say it.
DEFAULT_DRAIN_TIMEOUT = 120.0


def _tool(name: str) -> str | None:
    """An external tool on PATH, or in the virtualenv where .ci/check-deploy installs it."""
    found = shutil.which(name)
    if found:
        return found
    tools = Path(
        os.environ.get("HSX_TOOLS_VENV")
        or Path(os.environ.get("TMPDIR") or "/tmp") / "hsx-ci-tools"
    )
    candidate = tools / "bin" / name
    return str(candidate) if os.access(candidate, os.X_OK) else None


def _config_module() -> ModuleType | None:
    try:
        return importlib.import_module("hsx_async.config")
    except ModuleNotFoundError as exc:
        if exc.name != "hsx_async.config":
            raise
        return None


def _require_load_config() -> Any:
    module = _config_module()
    if module is None or not hasattr(module, "load_config"):
        pytest.skip("hsx_async.config.load_config is not in this build")
    return module.load_config


def _default_drain_timeout() -> float:
    module = _config_module()
    if module is None or not hasattr(module, "DaemonConfig"):
        return DEFAULT_DRAIN_TIMEOUT
    return float(module.DaemonConfig().drain_timeout)


def _size_bytes(text: str) -> int:
    """Bytes of a TOML size ("32GiB") or a Kubernetes quantity ("64Gi", "20Ti")."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", text)
    assert m, f"not a size: {text!r}"
    unit = (m.group(2) or "").upper().rstrip("B")
    powers = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    binary = {"KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}
    factor = binary[unit] if unit in binary else powers[unit]
    return int(float(m.group(1)) * factor)


# --- Kubernetes ----------------------------------------------------------------------


def _k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted([*K8S.glob("*.yaml"), *K8S.glob("*.yml")]):
        with path.open() as fh:
            docs += [(path, d) for d in yaml.safe_load_all(fh) if d is not None]
    return docs


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d
        for _, d in _k8s_docs()
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@dataclass(frozen=True)
class Pod:
    job: dict[str, Any]
    spec: dict[str, Any]
    sglang: dict[str, Any]
    hsx: dict[str, Any]
    config: dict[str, Any]  # the hsx config.toml from the ConfigMap, parsed
    configmap: dict[str, Any]

    def volume(self, name: str) -> dict[str, Any]:
        [vol] = [v for v in self.spec["volumes"] if v["name"] == name]
        assert isinstance(vol, dict)
        return vol

    @staticmethod
    def env(container: dict[str, Any]) -> dict[str, Any]:
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}

    @staticmethod
    def mounts(container: dict[str, Any]) -> dict[str, str]:
        return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


@pytest.fixture(scope="module")
def pod() -> Pod:
    job = _one("Job")
    spec = job["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}
    hsx = by_name["hsx"]
    cm_name = next(v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v)
    configmap = _one("ConfigMap", cm_name)
    config = tomllib.loads(configmap["data"]["config.toml"])
    return Pod(job, spec, by_name["sglang"], hsx, config, configmap)


def test_every_yaml_parses() -> None:
    paths = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert paths, "no YAML under deploy/"
    for path in paths:
        with path.open() as fh:
            docs = [d for d in yaml.safe_load_all(fh) if d is not None]
        assert docs, f"{path} holds no document"


# The least every manifest must have: what `kubectl apply` needs to place it, and for each
# kind the fields this deployment relies on. kubernetes-validate (below) checks the rest.
_REQUIRED: dict[str, list[str]] = {
    "Job": ["spec.template.spec.containers", "spec.completions", "spec.parallelism"],
    "ConfigMap": ["data"],
    "PersistentVolumeClaim": ["spec.accessModes", "spec.resources.requests.storage"],
}


def _get(doc: dict[str, Any], dotted: str) -> Any:
    node: Any = doc
    for part in dotted.split("."):
        assert isinstance(node, dict) and part in node, f"missing {dotted}"
        node = node[part]
    return node


def test_manifests_minimal_schema() -> None:
    docs = _k8s_docs()
    assert {d["kind"] for _, d in docs} == set(_REQUIRED)
    for path, doc in docs:
        assert isinstance(doc.get("apiVersion"), str), path
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), path
        for dotted in _REQUIRED[doc["kind"]]:
            _get(doc, dotted)
        for container in _containers(doc):
            assert {"name", "image"} <= container.keys(), (path, container)
            assert ":" in container["image"], f"{container['name']}: pin the image tag"
            assert not container["image"].endswith(":latest"), container["name"]


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] != "Job":
        return []
    spec = doc["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


@pytest.mark.parametrize("version", ["1.29.0", "latest"])
def test_manifests_against_kubernetes_schemas(version: str) -> None:
    try:
        kv = importlib.import_module("kubernetes_validate")
    except ModuleNotFoundError:
        pytest.skip("kubernetes-validate is not installed (.ci/check-deploy installs it)")
    wanted = kv.latest_version() if version == "latest" else version
    for path, doc in _k8s_docs():
        try:
            kv.validate(doc, wanted, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{path.name} {doc['kind']} vs Kubernetes {wanted}: {exc}")


def test_job_is_indexed_with_one_shard_per_pod(pod: Pod) -> None:
    spec = pod.job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] >= 1
    # hsx takes the index from JOB_COMPLETION_INDEX and the count from HSX_SHARD_COUNT.
    env = pod.env(pod.hsx)
    assert int(env["HSX_SHARD_COUNT"]) == spec["completions"]
    assert "JOB_COMPLETION_INDEX" not in env, "Kubernetes sets it; do not override it"
    assert "shard" not in pod.config, "[shard] in the file would override the Job's index"
    # podFailurePolicy and backoffLimitPerIndex need restartPolicy Never.
    assert pod.spec["restartPolicy"] == "Never"


def test_server_is_a_native_sidecar(pod: Pod) -> None:
    """An ordinary second container would keep the pod (and the Job) running forever."""
    assert pod.sglang in pod.spec.get("initContainers", [])
    assert pod.sglang["restartPolicy"] == "Always"
    assert pod.hsx in pod.spec["containers"]
    assert len(pod.spec["containers"]) == 1


def test_both_containers_share_a_memory_backed_dev_shm(pod: Pod) -> None:
    names = {pod.mounts(c).get("/dev/shm") for c in (pod.sglang, pod.hsx)}
    assert len(names) == 1 and None not in names, f"/dev/shm volumes: {names}"
    [name] = names
    assert name is not None
    empty_dir = pod.volume(name)["emptyDir"]
    assert empty_dir["medium"] == "Memory"
    budget = _size_bytes(pod.config["dump"]["shm_budget"])
    assert _size_bytes(empty_dir["sizeLimit"]) > budget, "sizeLimit must exceed shm_budget"


def test_hsx_container_runs_hsx_with_the_configmap(pod: Pod) -> None:
    command = [*pod.hsx.get("command", []), *pod.hsx.get("args", [])]
    assert command[:3] == ["hsx", "run", "--config"]
    config_path = Path(command[3])
    mounts = pod.mounts(pod.hsx)
    volume = pod.volume(mounts[str(config_path.parent)])
    assert volume["configMap"]["name"] == pod.configmap["metadata"]["name"]
    assert config_path.name in pod.configmap["data"]


LAUNCH = DEPLOY / "sglang" / "launch.sh"


def _sglang_port(pod: Pod) -> int:
    return int(pod.env(pod.sglang)["HSX_PORT"])


def test_sglang_runs_launch_sh_with_the_hook_environment(pod: Pod) -> None:
    script = " ".join([*pod.sglang.get("command", []), *pod.sglang.get("args", [])])
    m = re.search(r"exec (\S+/launch\.sh) /models/\S+", script)
    assert m, script
    assert pod.mounts(pod.sglang)[str(Path(m.group(1)).parent)] == "hsx-hook"
    # launch.sh is what runs SGLang with the flags the hook needs (PROTOCOL §2: a
    # prefix-cache hit would skip rows of the dump).
    launch = LAUNCH.read_text()
    for flag in ("-m sglang.launch_server", "--disable-radix-cache", "--forward-hooks"):
        assert flag in launch, flag
    env = pod.env(pod.sglang)
    assert env["HSX_DUMP_ROOT"] == pod.config["dump"]["root"]
    aux = [int(x) for x in env["HSX_AUX_LAYERS"].split(",")]
    assert aux == pod.config["model"]["aux_layers"]
    assert env["PYTHONPATH"] == str(Path(m.group(1)).parent)
    # Only hsx in the same pod may reach the server.
    assert env["HSX_HOST"] == "127.0.0.1"


def test_hook_copy_step_works(pod: Pod, tmp_path: Path) -> None:
    """The init container's one-liner, run here against a scratch directory."""
    [init] = [c for c in pod.spec["initContainers"] if c["name"] == "hsx-hook"]
    command = [*init["command"], *init.get("args", [])]
    assert command[:2] == ["python", "-c"]
    code = command[2]
    assert "/opt/hsx/sglang-launch.sh" in code and '"/opt/hsx-hook"' in code
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"(?m)^COPY deploy/sglang/launch\.sh /opt/hsx/sglang-launch\.sh$", dockerfile)
    code = code.replace('"/opt/hsx-hook"', repr(str(tmp_path))).replace(
        "/opt/hsx/sglang-launch.sh", str(LAUNCH)
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert (tmp_path / "hsx_async" / "protocol.py").is_file()
    assert os.access(tmp_path / "launch.sh", os.X_OK)


def test_hsx_reaches_the_sidecar(pod: Pod) -> None:
    port = _sglang_port(pod)
    for url in pod.config["server"]["urls"]:
        m = re.fullmatch(r"http://(127\.0\.0\.1|localhost):(\d+)/?", url)
        assert m, f"{url}: the server is in the same pod"
        assert int(m.group(2)) == port
    for probe in ("startupProbe", "livenessProbe"):
        probe_code = " ".join(pod.sglang[probe]["exec"]["command"])
        assert f"http://127.0.0.1:{port}/health" in probe_code, probe
    listen = pod.config["daemon"]["metrics_listen"]
    metrics_port = int(listen.rpartition(":")[2])
    assert metrics_port in {p["containerPort"] for p in pod.hsx["ports"]}
    annotations = pod.job["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == metrics_port


def test_grace_period_outlasts_the_drain(pod: Pod) -> None:
    drain = float(pod.config.get("daemon", {}).get("drain_timeout", _default_drain_timeout()))
    assert pod.spec["terminationGracePeriodSeconds"] >= drain + 60


def test_data_volume_is_the_shared_claim(pod: Pod) -> None:
    pvc = _one("PersistentVolumeClaim")
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in pod.spec["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert pvc["metadata"]["name"] in claims
    # Every shard writes into one dataset directory.
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    data_mount = next(
        path
        for path, name in pod.mounts(pod.hsx).items()
        if "persistentVolumeClaim" in pod.volume(name)
    )
    for key in (pod.config["input"]["path"], pod.config["output"]["dir"]):
        assert Path(key).is_relative_to(data_mount), f"{key} is not on the data volume"


def test_configmap_config_loads(pod: Pod, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load_config = _require_load_config()
    path = tmp_path / "config.toml"
    path.write_text(pod.configmap["data"]["config.toml"])
    # As in a pod of the Job: the shard comes from the environment.
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    monkeypatch.setenv("HSX_SHARD_COUNT", str(pod.job["spec"]["completions"]))
    config = load_config(path)
    assert (config.shard.index, config.shard.count) == (3, pod.job["spec"]["completions"])


# --- systemd -------------------------------------------------------------------------


def _parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd's ini dialect: a key may repeat (values accumulate), '#'/';' comments."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{path.name}:{n}: {raw!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _seconds(value: str) -> float:
    """A systemd time span: "300", "5min", "2min 30s", "1h"."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "hr": 3600}
    total = 0.0
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert parts and "".join(f"{n}{u}" for n, u in parts) == value.replace(" ", ""), value
    for number, unit in parts:
        total += float(number) * units[unit]
    return total


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return _parse_unit(UNIT)


def _last(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values, f"[{section}] {key}= is missing"
    return values[-1]


def test_unit_is_type_notify(unit: dict[str, dict[str, list[str]]]) -> None:
    assert _last(unit, "Service", "Type") == "notify"
    assert _last(unit, "Service", "NotifyAccess") == "main"
    exec_start = _last(unit, "Service", "ExecStart").split()
    assert exec_start[0].endswith("/hsx") and exec_start[1:3] == ["run", "--config"]


def test_unit_stop_timeout_outlasts_the_drain(unit: dict[str, dict[str, list[str]]]) -> None:
    stop = _seconds(_last(unit, "Service", "TimeoutStopSec"))
    drains = [_default_drain_timeout()]
    drains += [float(tomllib.loads(p.read_text())["daemon"]["drain_timeout"]) for p in EXAMPLES]
    assert stop >= max(drains) + 60
    assert _last(unit, "Service", "KillMode") == "mixed"


def _default_unreachable_timeout() -> float:
    module = _config_module()
    if module is None or not hasattr(module, "ServerConfig"):
        return 1800.0
    return float(module.ServerConfig(urls=("http://x",)).unreachable_timeout)


def test_unit_start_timeout_outlasts_the_wait_for_a_server(
    unit: dict[str, dict[str, list[str]]],
) -> None:
    """READY=1 follows the first healthy server, which hsx awaits for unreachable_timeout."""
    start = _seconds(_last(unit, "Service", "TimeoutStartSec"))
    waits = [_default_unreachable_timeout()]
    waits += [
        float(tomllib.loads(p.read_text())["server"].get("unreachable_timeout", waits[0]))
        for p in EXAMPLES
    ]
    assert start >= max(waits) + 5 * 60


def test_unit_watchdog_and_restart(unit: dict[str, dict[str, list[str]]]) -> None:
    watchdog = _seconds(_last(unit, "Service", "WatchdogSec"))
    # hsx pings every min(WatchdogSec/2, progress_interval): any progress interval works,
    # but a watchdog shorter than a minute would trip on an ordinary slow moment.
    assert watchdog >= 60
    assert _last(unit, "Service", "Restart") == "on-failure"
    reload_cmd = _last(unit, "Service", "ExecReload")
    assert re.fullmatch(r"/(usr/)?bin/kill -(s )?HUP \$MAINPID", reload_cmd), reload_cmd


def test_unit_hardening_keeps_dev_shm_shared(unit: dict[str, dict[str, list[str]]]) -> None:
    service = unit["Service"]
    assert _last(unit, "Service", "ProtectSystem") == "strict"
    # A private /dev (and so /dev/shm) would hide the server's dumps; RemoveIPC (implied by
    # DynamicUser) would delete them when the unit stops.
    for key in ("PrivateDevices", "RemoveIPC", "DynamicUser"):
        assert service.get(key, ["no"])[-1] in {"no", "false", "0", "off"}, key
    writable = " ".join(service.get("ReadWritePaths", [])).split()
    assert "/nvme/hsx-out" in writable  # the output dir of the example config
    assert any(p.lstrip("-") == "/dev/shm/hsx" for p in writable)


def _verify_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at an installed binary: verify checks it exists."""
    hsx = shutil.which("hsx") or str(Path(sys.executable).with_name("hsx"))
    target = hsx if os.access(hsx, os.X_OK) else shutil.which("true")
    assert target is not None
    text = re.sub(r"(?m)^ExecStart=\S+/hsx ", f"ExecStart={target} ", UNIT.read_text())
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    return copy


def _assert_systemd_verifies(unit: Path) -> None:
    """``systemd-analyze verify`` accepts the unit file: it exits 0 on unknown keys and
    bad values too, but names the unit in a message, so any such line is a finding."""
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    out = proc.stdout + proc.stderr
    findings = [line for line in out.splitlines() if unit.name in line]
    assert proc.returncode == 0 and not findings, out


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    _assert_systemd_verifies(_verify_copy(tmp_path))


MOUNT = DEPLOY / "systemd" / "dev-shm-hsx.mount"


def test_dump_root_mount_unit_is_a_huge_page_tmpfs_at_the_example_dump_root() -> None:
    """The optional mount unit (bench/README.md: huge pages cut the client's CPU per GB
    by more than half) mounts where the example config, the service and the hook expect."""
    mount = _parse_unit(MOUNT)["Mount"]
    where = mount["Where"][-1]
    # systemd requires the unit's name to be its escaped path.
    assert MOUNT.stem == where.strip("/").replace("-", "\\x2d").replace("/", "-")
    assert mount["Type"][-1] == mount["What"][-1] == "tmpfs"
    options = mount["Options"][-1].split(",")
    assert "huge=within_size" in options
    assert _size_bytes(next(o for o in options if o.startswith("size="))[5:]) >= 8 << 30
    config = tomllib.loads((DEPLOY / "examples" / "kimi-k2.5.toml").read_text())
    assert config["dump"]["root"] == where
    writable = " ".join(_parse_unit(UNIT)["Service"].get("ReadWritePaths", [])).split()
    assert any(p.lstrip("-") == where for p in writable)
    if shutil.which("systemd-analyze") is not None:
        _assert_systemd_verifies(MOUNT)


# --- example configs -----------------------------------------------------------------


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"kimi-k2.5.toml", "small-local.toml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_parses_as_toml(path: Path) -> None:
    data = tomllib.loads(path.read_text())
    assert {"server", "input", "output", "model"} <= data.keys()


def test_kimi_example_values() -> None:
    data = tomllib.loads((DEPLOY / "examples" / "kimi-k2.5.toml").read_text())
    assert data["model"] == {"hidden_size": 7168, "aux_layers": [2, 30, 58]}
    assert data["workers"]["concurrency"] == 16
    assert data["dump"]["root"] == "/dev/shm/hsx"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_loads_through_hsx_config(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load_config = _require_load_config()
    for var in ("JOB_COMPLETION_INDEX", "SLURM_ARRAY_TASK_ID", "HSX_SHARD_COUNT"):
        monkeypatch.delenv(var, raising=False)
    config = load_config(path)
    raw = tomllib.loads(path.read_text())
    assert list(config.model.aux_layers) == raw["model"]["aux_layers"]
    assert config.workers.concurrency == raw["workers"]["concurrency"]


def test_slurm_defaults_match_the_kimi_example() -> None:
    data = tomllib.loads((DEPLOY / "examples" / "kimi-k2.5.toml").read_text())
    text = SBATCH.read_text()
    aux = ",".join(str(k) for k in data["model"]["aux_layers"])
    assert f"HSX_AUX_LAYERS=${{HSX_AUX_LAYERS:-{aux}}}" in text
    assert f"HSX_DUMP_ROOT=${{HSX_DUMP_ROOT:-{data['dump']['root']}}}" in text
    port = data["server"]["urls"][0].rpartition(":")[2].rstrip("/")
    assert f"HSX_PORT=${{HSX_PORT:-{port}}}" in text


# --- shell scripts -------------------------------------------------------------------


@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=[p.name for p in SHELL_SCRIPTS])
def test_shellcheck(path: Path) -> None:
    shellcheck = _tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (.ci/check-deploy installs it)")
    proc = subprocess.run(
        [shellcheck, "--severity=style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=[p.name for p in SHELL_SCRIPTS])
def test_shell_scripts_parse_and_are_executable(path: Path) -> None:
    assert os.access(path, os.X_OK), f"chmod +x {path.relative_to(REPO)}"
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)


def test_sbatch_header() -> None:
    directives = re.findall(r"(?m)^#SBATCH\s+(\S+)", SBATCH.read_text())
    assert "--array=0-7" in directives
    assert any(d.startswith("--signal=B:USR1@") for d in directives)
    assert "--requeue" in directives


# The sbatch script, run for real with stand-ins for the server, hsx and scontrol. Each
# stand-in records what it was given. Two FIFOs order events without sleeping: the server
# writes "server-up" once it has recorded itself (hsx reads it before anything else), hsx
# writes "ready" once its SIGTERM handler is in place (read by the test, or by a server
# told to die once hsx is up).
_FAKE_SERVER = """\
import os, signal, sys
if sys.argv[1:] == ["-"]:  # launch.sh checking the hook settings: the real Python does it
    os.execv(sys.executable, [sys.executable, "-"])
d = os.environ["FAKE_DIR"]
# Like SGLang's scheduler processes: a child in the server's process group.
child = os.fork()
if child == 0:
    signal.pause()
    os._exit(0)
with open(d + "/server.pid", "w") as fh:
    fh.write(f"{os.getpid()} {os.getpgid(0)} {child}\\n")
with open(d + "/server.args", "w") as fh:
    fh.write("\\n".join(sys.argv[1:]))
with open(d + "/server-up", "w") as fh:
    fh.write("up")
if os.environ.get("FAKE_SERVER") == "die":
    with open(d + "/ready") as fh:
        fh.read()
    os.kill(child, signal.SIGKILL)
    sys.exit(1)
signal.pause()
"""

_FAKE_HSX = """\
import os, signal, sys
d = os.environ["FAKE_DIR"]
def drained(*_):
    with open(d + "/hsx.drained", "w") as fh:
        fh.write("yes")
    sys.exit(0)
signal.signal(signal.SIGTERM, drained)
with open(d + "/hsx.args", "w") as fh:
    fh.write("\\n".join(sys.argv[1:]))
with open(d + "/server-up") as fh:
    fh.read()
mode = os.environ.get("FAKE_HSX", "drain")
if mode.startswith("exit"):
    sys.exit(int(mode[4:]))
with open(d + "/ready", "w") as fh:
    fh.write("up")
signal.pause()
"""


@dataclass
class SbatchRun:
    proc: subprocess.Popen[str]
    fake: Path

    def wait_hsx_up(self) -> None:
        with (self.fake / "ready").open() as fh:
            assert fh.read() == "up"

    def finish(self) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err

    def read(self, name: str) -> str:
        return (self.fake / name).read_text()


StartSbatch = Callable[..., SbatchRun]


@pytest.fixture
def run_sbatch(tmp_path: Path) -> Iterator[StartSbatch]:
    if shutil.which("setsid") is None:
        pytest.skip("setsid (util-linux) is not installed")
    fake = tmp_path / "fake"
    fake.mkdir()
    os.mkfifo(fake / "ready")
    os.mkfifo(fake / "server-up")
    for name, body in (("sglang-python", _FAKE_SERVER), ("hsx", _FAKE_HSX)):
        (fake / name).write_text(f"#!{sys.executable}\n{body}")
        (fake / name).chmod(0o755)
    (fake / "scontrol").write_text(f'#!/bin/sh\necho "$@" > "{fake}/scontrol.args"\n')
    (fake / "scontrol").chmod(0o755)
    runs: list[SbatchRun] = []

    def start(**env: str) -> SbatchRun:
        full = {
            "PATH": f"{fake}:{os.environ['PATH']}",
            "FAKE_DIR": str(fake),
            "MODEL_PATH": "/models/test",
            "HSX_CONFIG": "/etc/hsx/test.toml",
            "HSX_BIN": str(fake / "hsx"),
            "HSX_PYTHON": str(fake / "sglang-python"),
            "SLURM_SUBMIT_DIR": str(REPO),
            "HSX_DUMP_ROOT": str(tmp_path / "shm"),
            "HSX_POLL_INTERVAL": "0.05",
            "SLURM_JOB_ID": "4242",
            "SLURM_ARRAY_JOB_ID": "4240",
            "SLURM_ARRAY_TASK_ID": "2",
            "SLURM_ARRAY_TASK_MIN": "0",
            **env,
        }
        proc = subprocess.Popen(["bash", str(SBATCH)], env=full, stderr=subprocess.PIPE, text=True)
        run = SbatchRun(proc, fake)
        runs.append(run)
        return run

    yield start
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate()
    # A failed test may leave the stand-in server (in its own process group) behind.
    pid_file = fake / "server.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pid_file.read_text().split()[1]), signal.SIGKILL)


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for init (the server's child, reparented)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in {"Z", "X"}


def _assert_server_gone(run: SbatchRun) -> None:
    pid, pgid, child = (int(x) for x in run.read("server.pid").split())
    assert pid == pgid, "the server should lead its own process group"
    assert _dead(pid)
    assert _dead(child), "the whole process group should be stopped"


def test_sbatch_runs_server_and_hsx_then_stops_the_server(run_sbatch: StartSbatch) -> None:
    run = run_sbatch(FAKE_HSX="exit0")
    code, err = run.finish()
    assert code == 0, err
    assert run.read("hsx.args").split("\n") == ["run", "--config", "/etc/hsx/test.toml"]
    # The server is deploy/sglang/launch.sh's command line.
    args = run.read("server.args").split("\n")
    assert args[:4] == ["-m", "sglang.launch_server", "--model-path", "/models/test"]
    assert args[args.index("--tp-size") + 1] == "8"
    assert args[args.index("--port") + 1] == "30000"
    assert "--disable-radix-cache" in args
    assert args[-1] == "--trust-remote-code"
    hooks = json.loads(args[args.index("--forward-hooks") + 1])
    assert hooks[0]["hook_factory"].startswith("hsx_async.server.")
    _assert_server_gone(run)
    assert not (run.fake / "scontrol.args").exists()


def test_sbatch_bad_hook_settings_stop_the_task(run_sbatch: StartSbatch) -> None:
    """launch.sh refuses them before loading the model; hsx is then stopped too."""
    run = run_sbatch(HSX_AUX_LAYERS="30,2")
    code, err = run.finish()
    assert code == 1, err
    assert "HSX_AUX_LAYERS" in err
    assert run.read("hsx.drained") == "yes"
    assert not (run.fake / "server.args").exists()


def test_sbatch_needs_the_launch_script(run_sbatch: StartSbatch, tmp_path: Path) -> None:
    run = run_sbatch(SLURM_SUBMIT_DIR=str(tmp_path))
    code, err = run.finish()
    assert code == 2
    assert "launch.sh is missing" in err
    assert not (run.fake / "hsx.args").exists()


def test_sbatch_passes_hsx_failure_through(run_sbatch: StartSbatch) -> None:
    run = run_sbatch(FAKE_HSX="exit3")
    code, err = run.finish()
    assert code == 3, err
    _assert_server_gone(run)


def test_sbatch_time_limit_drains_and_requeues(run_sbatch: StartSbatch) -> None:
    run = run_sbatch()
    run.wait_hsx_up()
    run.proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@360 sends
    code, err = run.finish()
    assert code == 0, err
    assert run.read("hsx.drained") == "yes"
    assert run.read("scontrol.args").split() == ["requeue", "4242"]
    _assert_server_gone(run)


def test_sbatch_sigterm_drains_without_requeue(run_sbatch: StartSbatch) -> None:
    run = run_sbatch()
    run.wait_hsx_up()
    run.proc.send_signal(signal.SIGTERM)
    code, err = run.finish()
    assert code == 0, err
    assert run.read("hsx.drained") == "yes"
    assert not (run.fake / "scontrol.args").exists()


def test_sbatch_server_death_stops_hsx(run_sbatch: StartSbatch) -> None:
    run = run_sbatch(FAKE_SERVER="die")  # exits once hsx is up
    code, err = run.finish()
    assert code == 1, err
    assert run.read("hsx.drained") == "yes"
    assert "the SGLang server exited" in err


def test_sbatch_rejects_an_array_not_starting_at_zero(run_sbatch: StartSbatch) -> None:
    run = run_sbatch(SLURM_ARRAY_TASK_MIN="1")
    code, err = run.finish()
    assert code == 2
    assert "must start at 0" in err
    assert not (run.fake / "hsx.args").exists()


# --- container image -----------------------------------------------------------------

_DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", _DOCKERFILE.read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_shape() -> None:
    ins = _instructions()
    assert ins[0] == ("FROM", "python:3.11-slim")
    runs = [rest for word, rest in ins if word == "RUN"]
    torch_at = next(
        i
        for i, r in enumerate(runs)
        if "torch==2.13.0" in r and "--index-url https://download.pytorch.org/whl/cpu" in r
    )
    project_at = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch_at < project_at, "install CPU torch before the project"
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert ("ENTRYPOINT", '["hsx"]') in ins


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pat) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = []
    for word, rest in _instructions():
        if word == "COPY":
            copied += rest.split()[:-1]
    assert copied
    for src in copied:
        assert (REPO / src).exists(), f"the Dockerfile copies {src}, which does not exist"
        assert not _dockerignored(src, patterns), f"{src} is excluded by .dockerignore"
    assert _dockerignored("hsx_async/protocol.py", patterns) is False
    for junk in (".venv/bin/python", ".git/HEAD", "hsx_async/__pycache__/cli.cpython-311.pyc"):
        assert _dockerignored(junk, patterns), junk


def test_hadolint() -> None:
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (.ci/check-deploy installs it)")
    proc = subprocess.run(
        [hadolint, str(_DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_sbatch_rejects_an_unknown_server_kind(run_sbatch: StartSbatch) -> None:
    run = run_sbatch(HSX_SERVER="vllm")
    code, err = run.finish()
    assert code == 2
    assert "HSX_SERVER=vllm: use sglang or fake" in err


def test_sbatch_resources_default_to_the_gpu_node() -> None:
    """The #SBATCH lines describe the 8-GPU node; the README says how to override them
    (tests/deploy/test_slurm.py runs the script with them overridden on a real Slurm)."""
    directives = re.findall(r"(?m)^#SBATCH\s+(\S+)", SBATCH.read_text())
    assert {"--gpus-per-node=8", "--cpus-per-task=32", "--mem=0"} <= set(directives)
    readme = (SBATCH.parent / "README.md").read_text()
    for flag in ("--gpus-per-node", "--cpus-per-task", "--mem", "HSX_SERVER"):
        assert flag in readme, f"deploy/slurm/README.md does not explain {flag}"
