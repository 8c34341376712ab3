"""A third engine is one module and one registry line (issue 38 item 4): a stand-in engine
registered by the test (:mod:`tests.engines.standin`) is a valid ``[server].engine``, and
``hsx run`` extracts a dataset through its paths from a fake server that serves only those.
Nothing on the client side names an engine outside :mod:`hsx_async.engines`."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hsx_async.config import config_from_dict
from hsx_async.engines import ENGINE_NAMES, ENGINES
from hsx_async.errors import ConfigError
from hsx_async.server.fake.server import FakeOptions, running_fake_server
from tests.e2e import SampleSet, check_dataset, config_raw, write_config, write_samples
from tests.engines import standin

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 90.0
H, AUX = 32, (1, 3)


def _raw(tmp: Path, **server: Any) -> dict[str, Any]:
    raw = config_raw(tmp, tmp / "in.jsonl", ["http://127.0.0.1:1"], tmp / "dumps")
    raw["server"].update(server)
    return raw


def test_a_registered_engine_is_a_valid_server_engine(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"server\.engine.*'standin' is not one of 'sglang' \| 'vllm'"
    ):
        config_from_dict(_raw(tmp_path, engine="standin"), base=tmp_path)
    with standin.registered():
        config = config_from_dict(_raw(tmp_path, engine="standin"), base=tmp_path)
        assert config.server.engine_of("http://127.0.0.1:1") == "standin"
        config = config_from_dict(
            _raw(tmp_path, urls=["http://127.0.0.1:1", "http://127.0.0.1:2"],
                 engines=["standin", "vllm"]),
            base=tmp_path,
        )  # fmt: skip
        assert config.server.engines == ("standin", "vllm")
        with pytest.raises(ConfigError, match=r"server\.engines\[0\].*'standin'"):
            config_from_dict(_raw(tmp_path, engines=["trt"]), base=tmp_path)
    assert "standin" not in ENGINES and ENGINE_NAMES == ("sglang", "vllm")


@pytest.mark.parametrize("value", [5, ["sglang"], ""])
def test_an_engine_that_is_no_name_is_refused_with_the_names(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match=r"'server\.engine': .* is not one of 'sglang' \| 'vllm'"):
        config_from_dict(_raw(tmp_path, engine=value), base=tmp_path)


async def _child(module: str, *args: str) -> tuple[int, str, str]:
    """``python -m module ARGS`` beside the test's event loop (which serves the fake
    server); killed past CHILD_TIMEOUT_S."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def _job(
    tmp: Path, url: str, dumps: Path, engine: str, **overrides: dict[str, Any]
) -> tuple[Path, SampleSet]:
    samples = write_samples(tmp / "in.jsonl", 12, max_len=40, bad_every=5)
    raw = config_raw(tmp, samples.path, [url], dumps, hidden_size=H, aux_layers=AUX, **overrides)
    raw["server"]["engine"] = engine
    raw["daemon"]["log_level"] = "warning"
    return write_config(tmp, raw), samples


async def _run_on_standin_server(
    tmp: Path, dumps: Path, engine: str, *, hook: bool = True, **overrides: dict[str, Any]
) -> tuple[int, str, str, SampleSet, int]:
    """``hsx run`` with the stand-in registered, its config naming ``engine`` (and
    ``overrides``), against a fake server serving only the stand-in's paths (``hook``
    False: a server without the hsx hook): (exit, stdout, stderr, the samples, the marked
    requests the server took)."""
    options = FakeOptions(
        hidden_size=H, aux_layers=AUX, dump_root=dumps, paths=standin.FAKE_PATHS, hook=hook
    )
    async with running_fake_server(options) as server:
        config, samples = _job(tmp, server.url, dumps, engine, **overrides)
        code, out, err = await _child(
            "tests.engines.standin", "run", "--config", str(config), "--no-report"
        )
    return code, out, err, samples, server.stats.hsx_requests


async def test_hsx_run_extracts_through_a_registered_engines_paths(
    tmp_path: Path, shm_root: Path
) -> None:
    code, out, err, samples, taken = await _run_on_standin_server(tmp_path, shm_root, "standin")
    assert code == 0, err
    assert taken >= len(samples.good)
    assert out.startswith(f"{len(samples.good)} samples written, {len(samples.bad_lines)} quar")
    check_dataset(tmp_path / "out", samples, hidden_size=H, num_layers=len(AUX) + 1)


async def test_an_unregistered_engine_stops_hsx_run_before_it_starts(tmp_path: Path) -> None:
    config, _ = _job(tmp_path, "http://127.0.0.1:1", tmp_path / "dumps", "standin")
    code, out, err = await _child("hsx_async", "run", "--config", str(config), "--no-report")
    assert code == 2 and out == ""
    assert "'server.engine': 'standin' is not one of 'sglang' | 'vllm'" in err, err


async def test_the_wrong_engine_is_named_from_the_registry(tmp_path: Path, shm_root: Path) -> None:
    """The config says sglang; the server answers 404 at /generate and serves the stand-in's
    info path: the run names the registered engine to set, and nothing is extracted."""
    code, out, err, _, taken = await _run_on_standin_server(tmp_path, shm_root, "sglang")
    assert code == 2, (out, err)
    assert "set [server].engine (or engines) to 'standin'" in err, err
    assert taken == 0


async def test_a_server_without_the_hook_is_told_where_the_engines_launch_is(
    tmp_path: Path, shm_root: Path
) -> None:
    """The stand-in's answer does not prove its hook took the request (``acks_mark``
    False): no dump is a hook that may not be loaded, and the reason names the engine's
    own ``deploy`` (before: deploy/sglang for every engine but vLLM)."""
    code, _, err, _, taken = await _run_on_standin_server(
        tmp_path, shm_root, "standin", hook=False,
        server={"unreachable_timeout": 3.0}, dump={"timeout": 0.5},
    )  # fmt: skip
    assert code == 3 and taken == 0, err
    assert "is the hsx hook loaded (deploy/standin)" in err.splitlines()[-1], err


def _engine_literals(path: Path) -> list[str]:
    names = set(ENGINE_NAMES)
    return [
        f"{path}:{node.lineno}: {node.value!r}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]


def test_no_client_module_names_an_engine() -> None:
    """Each engine is named in its own module only: no branch, default or list elsewhere
    on the client side (the server side holds each engine's hook: hsx_async.server.hooks)."""
    package = REPO / "hsx_async"
    found = [
        hit
        for path in sorted(package.rglob("*.py"))
        if path.relative_to(package).parts[0] not in ("engines", "server")
        for hit in _engine_literals(path)
    ]
    assert found == []
    assert _engine_literals(package / "engines" / "__init__.py") == []
