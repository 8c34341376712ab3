"""Every hook in the registry implements the engine interface (hsx_async/server/README.md):
it is declared once, for an engine the client knows; its engine loads it by the entry the
deploy files name; it marks requests by the one request rule, checks layers by the one
aux-layer rule, reads the dump root the one way; and its dumps are made by the one dumper
(PrefillDumper) and pass the client's own checks with the final state it declares.

The SGLang hook runs against the stand-ins of tests/server/sglang (SGLang's own classes
run in the real-SGLang tier); the vLLM hook's engine-free core writes what its connector
writes (the connector itself runs in the real-vLLM tier).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from hsx_async import protocol
from hsx_async.engines import ENGINE_NAMES
from hsx_async.protocol import FINAL_STATES
from hsx_async.run.dumps.dump import validate_dump
from hsx_async.server import hook_core
from hsx_async.server.dumper import BatchReport, PrefillDumper
from hsx_async.server.hooks import HOOKS
from hsx_async.server.sglang import hook as sglang_glue
from hsx_async.server.vllm import core as vllm_core
from tests.server.sglang.standins import LAYERS, CausalLM, H, make_api, params
from tests.server.sglang.test_settings import GOOD

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the calls of the shared rules and of the one dump path."""
    counts = dict.fromkeys(("dump_batch", "check_hsx_request", "check_aux_layers"), 0)
    real_dump = PrefillDumper.dump_batch

    def dump_batch(self: PrefillDumper, *args: Any, **kw: Any) -> BatchReport:
        counts["dump_batch"] += 1
        return real_dump(self, *args, **kw)

    monkeypatch.setattr(PrefillDumper, "dump_batch", dump_batch)
    for name in ("check_hsx_request", "check_aux_layers"):
        real = getattr(protocol, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            counts[_name] += 1
            return _real(*args, **kw)

        for module in (protocol, hook_core, sglang_glue, vllm_core):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted)
    return counts


def test_every_engine_has_one_hook_and_every_hook_an_engine() -> None:
    assert sorted(HOOKS) == sorted(ENGINE_NAMES)
    for name, spec in HOOKS.items():
        assert spec.engine == name and spec.final_state in FINAL_STATES
        importlib.import_module(spec.core)  # importable without its engine


def test_each_engine_loads_its_hook_by_the_entry_the_deploy_files_name() -> None:
    sglang = HOOKS["sglang"]
    assert sglang.entry in sglang_glue.forward_hooks_arg()
    module, attr = sglang.entry.split(":")
    assert getattr(importlib.import_module(module), attr) is sglang_glue.hsx_hook_factory
    vllm = HOOKS["vllm"]
    launch = (REPO / "deploy" / "vllm" / "launch.sh").read_text()
    module, attr = vllm.entry.split(":")
    assert f'"kv_connector":"{attr}"' in launch
    assert f'"kv_connector_module_path":"{module}"' in launch
    source = (REPO / Path(*module.split("."))).with_suffix(".py").read_text()
    assert f"class {attr}(" in source  # (importing it needs vLLM: the real-vLLM tier does)


@pytest.fixture
def sglang_api() -> Iterator[Any]:
    api = make_api([])
    try:
        yield api
    finally:
        sglang_glue.uninstall(api)


def test_the_sglang_hook_follows_the_interface(
    sglang_api: Any, shm_root: Path, monkeypatch: pytest.MonkeyPatch, calls: dict[str, int]
) -> None:
    monkeypatch.setenv("HSX_DUMP_ROOT", str(shm_root))
    monkeypatch.setenv("HSX_AUX_LAYERS", ",".join(map(str, LAYERS)))
    monkeypatch.setenv("HSX_WRITER_THREADS", "0")
    config = hook_core.HookConfig.from_env(dict(os.environ), server="sglang test")
    assert config.dump_root == shm_root  # through dump_root_from_env
    info = sglang_glue.ServerInfo(settings=GOOD, attn_tp_rank=0, served_model_name="m")
    state = sglang_glue.build_state(config, info)
    sglang_glue.install(state, sglang_api)
    runner = sglang_api.runner_cls(CausalLM())
    reqs = [
        sglang_api.req_cls("r1", list(range(5)), params()),
        sglang_api.req_cls("bad/rid", [1], params()),
    ]
    final, aux = runner.forward(SimpleNamespace(input=torch.randn(6, H), rids=["r1", "bad/rid"]))
    out = SimpleNamespace(
        hidden_states=aux, last_hidden_states=final, hidden_states_token_indices=None
    )
    result = sglang_api.result_cls(out, [5, 1])
    result.copy_to_cpu(False, return_hidden_states=True)
    batch = SimpleNamespace(reqs=reqs, prefix_lens=[0, 0], extend_lens=[5, 1])
    sglang_api.processor_cls().process_batch_result_prefill(batch, result)
    assert calls["check_aux_layers"] >= 1  # the capture layers, against the model's size
    assert calls["check_hsx_request"] >= 2  # Req.__init__ and the dumper's plan
    assert calls["dump_batch"] == 1
    check_the_dump(
        shm_root / "w0" / "r1", "r1", 5, H, LAYERS, final_state=HOOKS["sglang"].final_state
    )
    assert not (shm_root / "w0" / "bad").exists()


def test_the_vllm_hook_follows_the_interface(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch, calls: dict[str, int]
) -> None:
    plan = vllm_core.layer_plan([1, 3, 5, 6], 6, 8)
    assert calls["check_aux_layers"] == 1
    assert isinstance(vllm_core.marked_target({"hsx_ns": "w0", "hsx_rid": "a/b"}), str)
    target = vllm_core.marked_target({"hsx_ns": "w0", "hsx_rid": "r1"}, 4)
    assert isinstance(target, vllm_core.Target) and calls["check_hsx_request"] == 2
    monkeypatch.setenv("HSX_DUMP_ROOT", str(shm_root))
    root = hook_core.dump_root_from_env(dict(os.environ))
    config = vllm_core.hook_config(root, plan, model="m", server="vllm test")
    rows = np.arange(5 * 4 * 8, dtype=np.int16).view(np.uint8).reshape(5, -1)
    report = vllm_core.write_dump(config, target, [rows], num_tokens=5, plan=plan)
    assert report.committed == ["r1"] and calls["dump_batch"] == 1
    check_the_dump(
        shm_root / "w0" / "r1", "r1", 5, 8, (1, 3, 5), final_state=HOOKS["vllm"].final_state
    )


def check_the_dump(
    rid_dir: Path, rid: str, n: int, h: int, layers: tuple[int, ...], *, final_state: str
) -> None:
    meta_bytes = (rid_dir / "meta.json").read_bytes()
    dump = validate_dump(rid_dir, meta_bytes, rid=rid, num_tokens=n, hidden_size=h,
                         aux_layers=layers)  # fmt: skip
    assert dump.meta.final_state == final_state
