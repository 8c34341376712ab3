"""The SGLang glue, run against stand-ins for SGLang's classes and a tiny CPU torch model,
and the launch script run against a stand-in for ``sglang.launch_server``."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from hsx_async.errors import ConfigError
from hsx_async.protocol import (
    BF16_STORAGE,
    FP8,
    META_NAME,
    Storage,
    check_meta,
    parse_meta,
    storage_params,
)
from hsx_async.server.dumper import PrefillDumper
from hsx_async.server.hook_core import HookConfig
from hsx_async.server.hook_writer import BackgroundWriter
from hsx_async.server.pinned import IN_FLIGHT_PASSES, size_class
from hsx_async.server.sglang import hook as sglang_hook
from hsx_async.server.sglang.hook import (
    FORWARD_HOOK_SPEC,
    HookState,
    ServerInfo,
    SglangApi,
    apply_capture_layers,
    find_capture_stack,
    install,
    uninstall,
)
from tests.server.fp8 import FP8_ALL, FP8_ALL_V3, FP8_AUX, check_fp8_dump, read_bf16_rows
from tests.server.host_allocator import CachingHostAllocator, pinned_d2h
from tests.server.sglang.standins import (
    FULL,
    LAYERS,
    N_LAYERS,
    NS,
    NULL,
    SGLANG_DEFAULT_LAYERS,
    CausalLM,
    H,
    Stack,
    make_api,
    params,
    reference_rows,
)
from tests.server.sglang.test_settings import GOOD

REPO = Path(__file__).resolve().parents[3]
LAUNCH = REPO / "deploy" / "sglang" / "launch.sh"


def config(root: Path) -> HookConfig:
    return HookConfig(dump_root=root, aux_layers=LAYERS, model=None, server="sglang test")


@pytest.fixture
def d2h_calls() -> list[torch.Tensor]:
    return []


@pytest.fixture
def api(d2h_calls: list[torch.Tensor]) -> Iterator[SglangApi]:
    api = make_api(d2h_calls)
    try:
        yield api
    finally:
        uninstall(api)


@pytest.fixture(params=["sync", "background"])
def state(api: SglangApi, shm_root: Path, request: pytest.FixtureRequest) -> Iterator[HookState]:
    """The installed hook, writing on the scheduler thread (HSX_WRITER_THREADS=0) or
    through two background writer threads (the default in SGLang)."""
    cfg = config(shm_root)
    background = None
    if request.param == "background":
        background = BackgroundWriter(shm_root, threads=2, queue_bytes=1 << 20)
    dumper = PrefillDumper(cfg, model="tiny", sink=background)
    st = HookState(config=cfg, dumper=dumper, writer=True, background=background)
    install(st, api)
    try:
        yield st
    finally:
        if background is not None:
            background.close(10.0)
            assert background.alive == 0


def settle() -> None:
    """Wait until the installed hook's background writers (if any) have written all."""
    st = sglang_hook._Installed.state
    if st is not None and st.background is not None:
        assert st.background.flush(30.0), "the background writers did not drain"


def run_pass(
    api: SglangApi,
    runner: Any,
    reqs: list[Any],
    spans: list[tuple[int, int]],
    x: torch.Tensor,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Any, Any]:
    """One prefill pass over ``x`` (the batch's rows), then the hooked result processing.
    The forward gets a stand-in ForwardBatch naming the pass's rids, as SGLang's does."""
    final, aux = runner.forward(SimpleNamespace(input=x, rids=[r.rid for r in reqs]))
    out = SimpleNamespace(
        hidden_states=aux.to(dtype),
        last_hidden_states=final.to(dtype),
        hidden_states_token_indices=None,
    )
    batch = SimpleNamespace(
        reqs=reqs, prefix_lens=[s for s, _ in spans], extend_lens=[n for _, n in spans]
    )
    result = api.result_cls(out, [n for _, n in spans])
    result.copy_to_cpu(False, return_hidden_states=True)
    processor = api.processor_cls()
    processor.process_batch_result_prefill(batch, result)
    assert processor.calls == 1
    settle()
    return batch, result


def dump_rows(root: Path, rid: str, num_tokens: int, *, model: str = "tiny") -> np.ndarray:
    settle()
    d = root / NS / rid
    meta = parse_meta((d / META_NAME).read_bytes())
    check_meta(meta, rid=rid, num_tokens=num_tokens, hidden_size=H, aux_layers=LAYERS)
    assert meta.model == model
    parts = [
        np.fromfile(d / f"part-{s:010d}-{e:010d}.bin", dtype="<u2").reshape(e - s, 3, H)
        for s, e in meta.parts
    ]
    return np.concatenate(parts)


# --------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------


def test_req_init_marks_only_dumpable_requests(api: SglangApi, state: HookState) -> None:
    marked = api.req_cls("r1", [1, 2], params())
    assert marked.return_hidden_states_mode == FULL
    assert marked.return_hidden_states is False  # nothing goes into the JSON response
    for req in (
        api.req_cls("r2", [1], params(ns=None)),
        api.req_cls("r3", [1], params(ns="../x")),
        api.req_cls("../r4", [1], params()),
        api.req_cls("r5", [1], params(max_new_tokens=8)),
    ):
        assert req.return_hidden_states_mode == NULL


def test_copy_to_cpu_copies_the_final_hidden_state(
    api: SglangApi, state: HookState, d2h_calls: list[torch.Tensor]
) -> None:
    final = torch.ones(3, H)
    out = SimpleNamespace(last_hidden_states=final)
    result = api.result_cls(out, None)
    result.copy_to_cpu(False, True)
    assert d2h_calls == [final] and result.copies == [True]
    assert out.last_hidden_states is not final
    result.copy_to_cpu(False, return_hidden_states=False)
    result.copy_to_cpu(False, False)
    assert len(d2h_calls) == 1 and result.copies == [True, False, False]
    out.last_hidden_states = None
    result.copy_to_cpu(True)
    assert len(d2h_calls) == 1


@pytest.mark.parametrize("flag_based", [False, True])
def test_first_forward_sets_the_capture_layers(
    api: SglangApi, state: HookState, flag_based: bool
) -> None:
    model = CausalLM(flag_based=flag_based)
    runner = api.runner_cls(model)
    x = torch.randn(5, H)
    _, aux = runner.forward(x)
    assert state.stack is model.model
    assert state.graph_layers == tuple(SGLANG_DEFAULT_LAYERS)
    assert model.model.layers_to_capture == list(LAYERS)
    want = torch.from_numpy(reference_rows(x).view(np.int16)).view(torch.bfloat16)
    torch.testing.assert_close(aux.to(torch.bfloat16), want[:, :2, :].reshape(5, 2 * H))
    flags = [bool(getattr(layer, "_is_layer_to_capture", False)) for layer in model.model.layers]
    assert flags == [i in LAYERS for i in range(N_LAYERS)]


def test_capture_layers_must_exist() -> None:
    stack = Stack()
    with pytest.raises(ConfigError, match=r"\[2, 6, 9\] does not fit a model with 6 layers"):
        apply_capture_layers(stack, [2, 6, 9])
    assert stack.layers_to_capture == SGLANG_DEFAULT_LAYERS


def test_model_without_capture_stack_is_refused() -> None:
    with pytest.raises(ConfigError, match="no decoder stack with a layers_to_capture"):
        find_capture_stack(nn.Sequential(nn.Linear(2, 2)))


def test_install_is_idempotent_and_uninstall_restores(
    api: SglangApi, state: HookState, shm_root: Path
) -> None:
    patched = api.processor_cls.__dict__["process_batch_result_prefill"]
    install(HookState(config(shm_root), PrefillDumper(config(shm_root)), True), api)
    assert api.processor_cls.__dict__["process_batch_result_prefill"] is patched
    assert sglang_hook._Installed.state is state
    uninstall(api)
    for cls, name in (
        (api.req_cls, "__init__"),
        (api.result_cls, "copy_to_cpu"),
        (api.runner_cls, "forward"),
        (api.processor_cls, "process_batch_result_prefill"),
    ):
        assert not hasattr(cls.__dict__[name], "__hsx_original__")
    assert api.req_cls("r1", [1], params()).return_hidden_states_mode == NULL


def test_install_refuses_a_moved_method(api: SglangApi, shm_root: Path) -> None:
    del api.runner_cls.forward
    st = HookState(config(shm_root), PrefillDumper(config(shm_root)), True)
    with pytest.raises(ConfigError, match=r"Runner\.forward missing"):
        install(st, api)
    assert "__hsx_original__" not in dir(api.req_cls.__dict__["__init__"])


# --------------------------------------------------------------------------------------
# Prefill results → dumps
# --------------------------------------------------------------------------------------


def test_mixed_and_chunked_passes_dump_exact_rows(
    api: SglangApi, state: HookState, shm_root: Path
) -> None:
    runner = api.runner_cls(CausalLM())
    user = api.req_cls("user-1", list(range(3)), params(ns=None, max_new_tokens=16))
    short = api.req_cls("short", list(range(4)), params())
    long = api.req_cls("long", list(range(7)), params())
    long.inflight_middle_chunks = 1  # its first chunk is a middle chunk
    x1 = torch.randn(3 + 4 + 5, H)
    run_pass(api, runner, [user, short, long], [(0, 3), (0, 4), (0, 5)], x1)
    assert (shm_root / NS / "short" / META_NAME).exists()
    assert not (shm_root / NS / "long" / META_NAME).exists()
    assert not (shm_root / NS / "user-1").exists()

    x2 = torch.randn(2, H)
    run_pass(api, runner, [long], [(5, 2)], x2)
    ref1, ref2 = reference_rows(x1), reference_rows(x2)
    np.testing.assert_array_equal(dump_rows(shm_root, "short", 4), ref1[3:7])
    np.testing.assert_array_equal(dump_rows(shm_root, "long", 7), np.concatenate([ref1[7:], ref2]))
    assert sorted(p.name for p in (shm_root / NS / "long").iterdir()) == [
        "meta.json",
        "part-0000000000-0000000005.bin",
        "part-0000000005-0000000007.bin",
    ]


def test_non_writer_rank_writes_nothing(api: SglangApi, state: HookState, shm_root: Path) -> None:
    state.writer = False
    runner = api.runner_cls(CausalLM())
    req = api.req_cls("r1", [1, 2], params())
    run_pass(api, runner, [req], [(0, 2)], torch.randn(2, H))
    assert req.finished()  # SGLang's own processing still ran
    # Nor does it quantize: an FP8 pass is copied as SGLang copies it.
    fp8 = api.req_cls("r2", [1, 2], params(**storage_params(FP8_ALL)))
    _, result = run_pass(api, runner, [fp8], [(0, 2)], torch.randn(2, H))
    assert fp8.finished() and result.logits_output.hidden_states is not None
    assert state.encoded_passes == 0 and not state.storages
    assert list(shm_root.iterdir()) == []


def test_aborted_and_retracted_requests_get_no_meta(
    api: SglangApi, state: HookState, shm_root: Path
) -> None:
    runner = api.runner_cls(CausalLM())
    aborting = api.req_cls("ab", [1, 2], params())
    aborting.to_finish = "abort"
    retracted = api.req_cls("re", [1, 2, 3], params())
    retracted.is_retracted = True
    run_pass(api, runner, [aborting, retracted], [(0, 2), (0, 3)], torch.randn(5, H))
    assert list(shm_root.iterdir()) == []


def test_graph_replay_with_other_layers_is_refused(
    api: SglangApi, state: HookState, shm_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = api.runner_cls(CausalLM())
    final, aux = runner.forward(torch.randn(2, H))
    out = SimpleNamespace(
        hidden_states=aux, last_hidden_states=final, hidden_states_token_indices=None
    )
    result = api.result_cls(out, [2])
    result.can_run_cuda_graph = True
    batch = SimpleNamespace(
        reqs=[api.req_cls("r1", [1, 2], params())], prefix_lens=[0], extend_lens=[2]
    )
    with caplog.at_level(logging.WARNING, logger=sglang_hook.__name__):
        api.processor_cls().process_batch_result_prefill(batch, result)
    assert "--disable-prefill-cuda-graph" in caplog.text
    assert list(shm_root.iterdir()) == []


@pytest.mark.parametrize(
    ("breakage", "fragment"),
    [
        ("no_aux", "--enable-return-aux-hidden-states"),
        ("no_final", "--enable-return-aux-hidden-states"),
        ("subset", "subset of its rows"),
        ("layers_reset", "something reset them"),
        ("no_forward", "no forward has gone through"),
    ],
)
def test_unusable_pass_is_refused(
    api: SglangApi,
    state: HookState,
    caplog: pytest.LogCaptureFixture,
    breakage: str,
    fragment: str,
) -> None:
    model = CausalLM()
    if breakage == "no_forward":  # the model ran, but not through the hooked runner
        final, aux = model.model(torch.randn(2, H))
    else:
        final, aux = api.runner_cls(model).forward(torch.randn(2, H))
    out = SimpleNamespace(
        hidden_states=None if breakage == "no_aux" else aux,
        last_hidden_states=None if breakage == "no_final" else final,
        hidden_states_token_indices=torch.arange(1) if breakage == "subset" else None,
    )
    if breakage == "layers_reset":
        model.model.layers_to_capture = [0, 1]
    batch = SimpleNamespace(
        reqs=[api.req_cls("r1", [1, 2], params())], prefix_lens=[0], extend_lens=[2]
    )
    with caplog.at_level(logging.WARNING, logger=sglang_hook.__name__):
        api.processor_cls().process_batch_result_prefill(batch, api.result_cls(out, [2]))
    assert fragment in caplog.text
    assert list(state.config.dump_root.iterdir()) == []


def test_odd_batch_layout_is_logged_not_fatal(
    api: SglangApi, state: HookState, shm_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    req = api.req_cls("r1", [1, 2], params())
    batch = SimpleNamespace(reqs=[req], prefix_lens=[], extend_lens=[2])
    with caplog.at_level(logging.ERROR, logger=sglang_hook.__name__):
        api.processor_cls().process_batch_result_prefill(batch, api.result_cls(None, None))
    assert "cannot map a prefill pass" in caplog.text
    assert req.finished()


def test_extend_lens_fall_back_to_the_batch(
    api: SglangApi, state: HookState, shm_root: Path
) -> None:
    runner = api.runner_cls(CausalLM())
    x = torch.randn(3, H)
    final, aux = runner.forward(x)
    out = SimpleNamespace(
        hidden_states=aux, last_hidden_states=final, hidden_states_token_indices=None
    )
    batch = SimpleNamespace(
        reqs=[api.req_cls("r1", [1, 2, 3], params())], prefix_lens=[0], extend_lens=[3]
    )
    result = api.result_cls(out, None)
    api.processor_cls().process_batch_result_prefill(batch, result)
    assert result.copy_done.synchronized == 1
    np.testing.assert_array_equal(dump_rows(shm_root, "r1", 3), reference_rows(x))


def on_a_device(
    api: SglangApi, root: Path, monkeypatch: pytest.MonkeyPatch, *, device_stack: bool | None
) -> BackgroundWriter:
    """The hook installed with two writer threads, taking CPU tensors for device ones."""
    monkeypatch.setattr(sglang_hook, "_on_accelerator", lambda t: True)
    cfg = dataclasses.replace(config(root), device_stack=device_stack)
    background = BackgroundWriter(root, threads=2, queue_bytes=1 << 20)
    st = HookState(cfg, PrefillDumper(cfg, model="tiny", sink=background), True)
    st.background = background
    install(st, api)
    return background


def test_device_stack_makes_one_copy_and_dumps_the_same_rows(
    api: SglangApi, shm_root: Path, d2h_calls: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """HSX_DEVICE_STACK=1, run on CPU tensors posing as device ones: the pass is laid out
    as [T, K+1, H] before ONE d2h copy, the logits output gets host views of it, and the
    parts come out as slices of that buffer, equal to the plain path's rows."""
    background = on_a_device(api, shm_root, monkeypatch, device_stack=True)
    try:
        runner = api.runner_cls(CausalLM())
        x = torch.randn(3 + 5, H)
        reqs = [api.req_cls("a", [1, 2, 3], params()), api.req_cls("b", list(range(5)), params())]
        _, result = run_pass(api, runner, reqs, [(0, 3), (0, 5)], x)
        [copied] = d2h_calls
        assert copied.shape == (8, len(LAYERS) + 1, H)
        out = result.logits_output
        assert out.hidden_states.shape == (8, len(LAYERS) * H)
        assert out.hidden_states.stride() == ((len(LAYERS) + 1) * H, 1)
        ref = reference_rows(x)
        np.testing.assert_array_equal(dump_rows(shm_root, "a", 3), ref[:3])
        np.testing.assert_array_equal(dump_rows(shm_root, "b", 5), ref[3:])
    finally:
        background.close(10.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_device_stack_is_the_default_for_both_measured_dtypes(
    api: SglangApi,
    shm_root: Path,
    d2h_calls: list[torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
) -> None:
    """Issue 40: with HSX_DEVICE_STACK unset, a pass on a device is stacked and copied
    once, for a bfloat16 and a float32 model alike (the faster path on an H200)."""
    background = on_a_device(api, shm_root, monkeypatch, device_stack=None)
    try:
        runner = api.runner_cls(CausalLM())
        x = torch.randn(4, H)
        reqs = [api.req_cls("a", list(range(4)), params())]
        run_pass(api, runner, reqs, [(0, 4)], x, dtype=dtype)
        assert [(t.shape, t.dtype) for t in d2h_calls] == [
            ((4, len(LAYERS) + 1, H), torch.bfloat16)
        ]
        np.testing.assert_array_equal(dump_rows(shm_root, "a", 4), reference_rows(x))
    finally:
        background.close(10.0)


@pytest.mark.parametrize("device_stack", [False, True], ids=["plain", "stack"])
def test_a_float32_model_on_a_device_is_rounded_there_or_by_the_writers(
    api: SglangApi,
    shm_root: Path,
    d2h_calls: list[torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
    device_stack: bool,
) -> None:
    """Issue 28: on a device, the hook rounds what it copies to bfloat16 there (the final
    rows; the whole stack with HSX_DEVICE_STACK=1), SGLang copies the plain path's aux
    rows as float32 and the writers round those; the scheduler thread rounds nothing.
    Either way the dump holds the rows' bfloat16 rounding (CPU tensors posing as device
    ones)."""
    background = on_a_device(api, shm_root, monkeypatch, device_stack=device_stack)
    try:
        runner = api.runner_cls(CausalLM())
        x = torch.randn(6, H)
        reqs = [api.req_cls("a", list(range(6)), params())]
        _, result = run_pass(api, runner, reqs, [(0, 6)], x, dtype=torch.float32)
        assert [t.dtype for t in d2h_calls] == [torch.bfloat16]  # the hook's own copy
        out = result.logits_output
        assert out.last_hidden_states.dtype == torch.bfloat16
        assert out.hidden_states.dtype == (torch.bfloat16 if device_stack else torch.float32)
        np.testing.assert_array_equal(dump_rows(shm_root, "a", 6), reference_rows(x))
    finally:
        background.close(10.0)


def test_device_stack_needs_matching_shapes() -> None:
    d2h = lambda t: t  # noqa: E731
    assert sglang_hook.stack_to_host(None, torch.zeros(2, H), d2h) is None
    assert sglang_hook.stack_to_host(torch.zeros(2, 3), torch.zeros(2, H), d2h) is None
    assert sglang_hook.stack_to_host(torch.zeros(0, H), torch.zeros(0, H), d2h) is None
    mixed = sglang_hook.stack_to_host(
        torch.zeros(2, H), torch.zeros(2, H, dtype=torch.bfloat16), d2h
    )
    assert mixed is None


# --------------------------------------------------------------------------------------
# FP8 storage
# --------------------------------------------------------------------------------------


def fp8_req(api: SglangApi, rid: str, n: int, storage: Storage) -> Any:
    """A marked request asking for ``storage`` (nothing more for bfloat16)."""
    return api.req_cls(rid, list(range(n)), params(**storage_params(storage)))


@pytest.mark.parametrize(
    "storage", [FP8_ALL, FP8_AUX, FP8_ALL_V3], ids=["all", "aux", "all-per_token_slot"]
)
def test_fp8_pass_is_quantized_on_the_device(
    api: SglangApi,
    state: HookState,
    shm_root: Path,
    d2h_calls: list[torch.Tensor],
    storage: Storage,
) -> None:
    """A pass whose requests all ask for one FP8 storage (float32 rows, as on the CPU
    tier): quantized before the copy, only the sections' bytes cross to the host, SGLang's
    own aux copy is skipped, and every part equals encode_rows of the bfloat16 dump of the
    same rows (a chunked request included)."""
    runner = api.runner_cls(CausalLM())
    x1, x2 = torch.randn(3 + 4, H), torch.randn(2, H)
    for prefix, wanted in (("bf", BF16_STORAGE), ("q", storage)):
        d2h_calls.clear()
        short, long = (
            fp8_req(api, f"{prefix}-short", 3, wanted),
            fp8_req(api, f"{prefix}-long", 6, wanted),
        )
        long.inflight_middle_chunks = 1
        _, result = run_pass(api, runner, [short, long], [(0, 3), (0, 4)], x1, dtype=torch.float32)
        run_pass(api, runner, [long], [(4, 2)], x2, dtype=torch.float32)
        if prefix == "q":
            assert state.encoded_passes == 2 and state.encoded_storages == {storage}
            assert result.logits_output.hidden_states is None  # no bfloat16 aux copy
            assert all(t.dtype == torch.uint8 for t in d2h_calls)
            per_row = storage.row_bytes(len(LAYERS) + 1, H)
            assert sum(t.nbytes for t in d2h_calls) == (7 + 2) * per_row
        else:
            assert state.encoded_passes == 0
    settle()
    for name in ("short", "long"):
        bf16 = read_bf16_rows(shm_root / NS / f"bf-{name}")
        check_fp8_dump(shm_root / NS / f"q-{name}", bf16, storage, aux_layers=LAYERS)
    assert state.storages == {}  # forgotten after their last chunk


def test_mixed_fp8_pass_is_quantized_by_the_writer(
    api: SglangApi, state: HookState, shm_root: Path
) -> None:
    """An FP8 request batched with a bfloat16 one and ordinary traffic: the pass is copied
    as bfloat16 (SGLang's copy included), and the FP8 parts are quantized on the host."""
    runner = api.runner_cls(CausalLM())
    user = api.req_cls("user-1", list(range(2)), params(ns=None, max_new_tokens=16))
    bf = api.req_cls("bf", list(range(3)), params())
    q = fp8_req(api, "q", 3, FP8_AUX)
    x = torch.randn(2 + 3 + 3, H)
    _, result = run_pass(api, runner, [user, bf, q], [(0, 2), (0, 3), (0, 3)], x)
    assert state.encoded_passes == 0 and result.logits_output.hidden_states is not None
    ref = reference_rows(x)
    np.testing.assert_array_equal(dump_rows(shm_root, "bf", 3), ref[2:5])
    check_fp8_dump(shm_root / NS / "q", ref[5:8], FP8_AUX, aux_layers=LAYERS)


def test_unusable_fp8_request_is_dumped_bf16_and_logged_once(
    api: SglangApi, state: HookState, shm_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = api.runner_cls(CausalLM())
    bad = api.req_cls("bad", list(range(5)), params(hsx_dtype=FP8, hsx_quantized=[0, 3]))
    bad.inflight_middle_chunks = 1
    x1, x2 = torch.randn(3, H), torch.randn(2, H)
    with caplog.at_level(logging.WARNING, logger=sglang_hook.__name__):
        run_pass(api, runner, [bad], [(0, 3)], x1)
        run_pass(api, runner, [bad], [(3, 2)], x2)
    lines = [r.getMessage() for r in caplog.records if "bad" in r.getMessage()]
    assert len(lines) == 1 and "dumped as bfloat16" in lines[0] and "past the 3" in lines[0]
    assert state.encoded_passes == 0
    want = np.concatenate([reference_rows(x1), reference_rows(x2)])
    np.testing.assert_array_equal(dump_rows(shm_root, "bad", 5), want)
    assert read_bf16_rows(shm_root / NS / "bad").shape == (5, len(LAYERS) + 1, H)


def test_encode_to_host_needs_matching_shapes() -> None:
    d2h = lambda t: t  # noqa: E731
    encode = sglang_hook.encode_to_host
    assert encode(None, torch.zeros(2, H), FP8_ALL, d2h) is None
    assert encode(torch.zeros(2, 3), torch.zeros(2, H), FP8_ALL, d2h) is None
    assert encode(torch.zeros(0, H), torch.zeros(0, H), FP8_ALL, d2h) is None
    # One aux layer: L = 2, so slot 2 does not exist.
    assert encode(torch.zeros(2, H), torch.zeros(2, H), FP8_ALL, d2h) is None
    sections = encode(torch.zeros(2, 2 * H), torch.zeros(2, H), FP8_AUX, d2h)
    assert sections is not None
    # values, scales, the 16 outliers' uint16 channels and bf16 values, the kept slot
    assert [tuple(s.shape) for s in sections] == [
        (2, 2 * H), (2, 2 * 4), (2, 2 * 16 * 2), (2, 2 * 16 * 2), (2, H * 2)
    ]  # fmt: skip


# --------------------------------------------------------------------------------------
# Page-locked memory made ready before the first pass (issue 40)
# --------------------------------------------------------------------------------------


def normed_model(dtype: torch.dtype = torch.bfloat16) -> CausalLM:
    """The stand-in model with a final norm on its decoder stack (SGLang's models have one,
    built in the served dtype): the warm-up reads the hidden size and dtype from it."""
    model = CausalLM()
    model.model.norm = nn.LayerNorm(H, dtype=dtype)
    return model


def warming_state(
    api: SglangApi,
    root: Path,
    allocate: Any,
    *,
    pass_rows: int,
    queue_bytes: int,
    device_stack: bool | None = None,
) -> HookState:
    cfg = dataclasses.replace(
        config(root), pass_rows=pass_rows, write_queue_bytes=queue_bytes, device_stack=device_stack
    )
    background = BackgroundWriter(root, threads=2, queue_bytes=queue_bytes)
    dumper = PrefillDumper(cfg, model="tiny", sink=background)
    st = HookState(cfg, dumper, True, background=background, allocate_pinned=allocate)
    install(st, api)
    return st


def test_the_first_forward_makes_page_locked_memory_ready_and_no_pass_grows_it(
    api: SglangApi,
    shm_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before the first pass, the writing rank allocates (then frees into PyTorch's cache)
    every block its passes will hold: the passes' own copies (SGLang's async_d2h, here
    from a model of the caching host allocator) then never grow it, and the log says what
    the warm-up made ready and what it cost. (Before issue 40 the first passes grew it.)"""
    monkeypatch.setattr(sglang_hook, "_on_accelerator", lambda t: True)
    allocator = CachingHostAllocator()
    hooked = dataclasses.replace(api, async_d2h=pinned_d2h(allocator))
    rows = 6
    pass_bytes = rows * (len(LAYERS) + 1) * H * 2  # the device stack, bfloat16
    st = warming_state(
        hooked, shm_root, allocator.allocate, pass_rows=rows, queue_bytes=2 * pass_bytes
    )
    assert st.background is not None
    caplog.set_level(logging.INFO, logger=sglang_hook.__name__)
    try:
        runner = hooked.runner_cls(normed_model())
        for p in range(5):
            x = torch.randn(rows, H)
            reqs = [hooked.req_cls(f"r{p}", list(range(rows)), params())]
            run_pass(hooked, runner, reqs, [(0, rows)], x)
            np.testing.assert_array_equal(dump_rows(shm_root, f"r{p}", rows), reference_rows(x))
    finally:
        st.background.close(10.0)
    warmed = [size_class(pass_bytes)] * (2 + IN_FLIGHT_PASSES)  # two queued, two in flight
    assert allocator.grown == warmed  # the warm-up's blocks, and not one pass's
    assert st.warmed is not None and st.warmed.nbytes == sum(warmed) and not st.warmed.error
    [line] = [r.getMessage() for r in caplog.records if "made ready" in r.getMessage()]
    match = re.search(r"(\d+) blocks .*, (\d+\.\d\d) GB in (\d+\.\d\d) s", line)
    assert match is not None, line
    assert int(match[1]) == len(warmed) and float(match[2]) == round(sum(warmed) / 1e9, 2)
    assert float(match[3]) == round(st.warmed.seconds, 2)
    assert f"passes of {rows} rows (H {H}" in line and "device stack path" in line


def test_the_warm_up_sizes_a_float32_models_plain_copies(
    api: SglangApi, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HSX_DEVICE_STACK=0 and a float32 model: SGLang's aux copy in float32 and the hook's
    bfloat16 final copy, each in its own size class, made ready for every pass held."""
    monkeypatch.setattr(sglang_hook, "_on_accelerator", lambda t: True)
    allocator = CachingHostAllocator()
    hooked = dataclasses.replace(api, async_d2h=pinned_d2h(allocator))
    rows, k = 6, len(LAYERS)
    aux, final = rows * k * H * 4, rows * H * 2
    st = warming_state(
        hooked, shm_root, allocator.allocate, pass_rows=rows, queue_bytes=1, device_stack=False
    )
    assert st.background is not None
    try:
        runner = hooked.runner_cls(normed_model(torch.float32))
        runner.forward(torch.randn(rows, H))
        passes = 1 + IN_FLIGHT_PASSES  # a budget below one pass: one let through alone
        assert sorted(allocator.grown) == sorted(
            [size_class(aux)] * passes + [size_class(final)] * passes
        )
    finally:
        st.background.close(10.0)


@pytest.mark.parametrize("why", ["no-cuda", "rows-0", "no-norm"])
def test_the_warm_up_is_a_no_op_said_in_the_log(
    api: SglangApi,
    shm_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    why: str,
) -> None:
    """A CPU-only torch has no page-locked memory: nothing is allocated and the log says
    why, as it does for HSX_PASS_ROWS=0 and a stack without a final norm."""
    allocator = CachingHostAllocator()
    allocate: Any = allocator.allocate
    if why == "no-cuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        allocate = sglang_hook.pinned_allocator()
        assert allocate is None
    st = warming_state(
        api, shm_root, allocate, pass_rows=0 if why == "rows-0" else 6, queue_bytes=1 << 20
    )
    caplog.set_level(logging.INFO, logger=sglang_hook.__name__)
    try:
        model = CausalLM() if why == "no-norm" else normed_model()
        api.runner_cls(model).forward(torch.randn(3, H))
    finally:
        assert st.background is not None
        st.background.close(10.0)
    assert allocator.grown == [] and st.warmed is None
    lines = [r.getMessage() for r in caplog.records if "page-locked" in r.getMessage()]
    expected = {
        "no-cuda": "(torch has no page-locked memory here (no CUDA))",
        "rows-0": "(HSX_PASS_ROWS=0)",
        "no-norm": "(Stack has no final norm to read the hidden size from)",
    }[why]
    assert lines == [f"hsx hook: no page-locked host memory made ready {expected}"]


def test_a_non_writing_rank_warms_only_the_passes_in_flight(
    api: SglangApi, shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-writing rank copies its passes too (SGLang's own aux copy at least) but queues
    none for writers: it makes ready the passes in flight, so its first passes (which its
    peers wait for) grow nothing either."""
    monkeypatch.setattr(sglang_hook, "_on_accelerator", lambda t: True)
    allocator = CachingHostAllocator()
    hooked = dataclasses.replace(api, async_d2h=pinned_d2h(allocator))
    rows = 6
    cfg = dataclasses.replace(config(shm_root), pass_rows=rows)
    st = HookState(cfg, PrefillDumper(cfg, model="tiny"), False, allocate_pinned=allocator.allocate)
    install(st, hooked)
    runner = hooked.runner_cls(normed_model())
    pass_bytes = rows * (len(LAYERS) + 1) * H * 2
    for p in range(3):
        reqs = [hooked.req_cls(f"r{p}", list(range(rows)), params())]
        run_pass(hooked, runner, reqs, [(0, rows)], torch.randn(rows, H))
    assert allocator.grown == [size_class(pass_bytes)] * IN_FLIGHT_PASSES
    assert not (shm_root / NS).exists()  # and it wrote nothing


def test_pinned_allocator_takes_page_locked_memory_as_async_d2h_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def empty(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "block"

    monkeypatch.setattr(torch, "empty", empty)
    allocate = sglang_hook.pinned_allocator()
    assert allocate is not None and allocate(4096) == "block"
    assert calls == [((4096,), {"dtype": torch.uint8, "pin_memory": True})]


def test_host_rows_keeps_row_strided_views() -> None:
    full = torch.randn(4, 3, H).to(torch.bfloat16)
    aux = full.as_strided((4, 2 * H), (3 * H, 1))
    bits = sglang_hook.host_rows(aux)
    assert np.shares_memory(bits, full.view(torch.int16).numpy())
    np.testing.assert_array_equal(bits, aux.contiguous().view(torch.int16).numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_host_rows_of_a_float_model_stay_floats_for_the_writers(dtype: torch.dtype) -> None:
    """Issue 28: the scheduler thread no longer rounds a float32 model's rows to bfloat16;
    it hands the host rows over as they are (no copy), and the writers round them."""
    t = torch.tensor([[1.0, -2.5], [0.0, 3.0]], dtype=dtype)
    rows = sglang_hook.host_rows(t)
    assert rows.dtype == t.numpy().dtype and np.shares_memory(rows, t.numpy())
    assert sglang_hook.host_rows(t.to(torch.float64)).dtype == np.float32


def test_as_bf16_rounds_where_the_tensor_lies() -> None:
    t = torch.tensor([1.0 + 2**-8, 3.0], dtype=torch.float32)
    assert sglang_hook.as_bf16(t).dtype == torch.bfloat16
    assert torch.equal(sglang_hook.as_bf16(t), t.to(torch.bfloat16))
    b = t.to(torch.bfloat16)
    assert sglang_hook.as_bf16(b) is b


@pytest.mark.parametrize(
    ("rid", "params", "max_new", "expected"),
    [
        ("r1", {"hsx_ns": "w0"}, 0, True),
        ("r1", {"hsx_ns": "w0"}, 1, False),
        ("r1", {"hsx_ns": "w0"}, None, False),
        ("r1", None, 0, False),
        ("r1", {"hsx_ns": "../w0"}, 0, False),
        ("../r1", {"hsx_ns": "w0"}, 0, False),
        ("r1\n", {"hsx_ns": "w0"}, 0, False),
        (17, {"hsx_ns": "w0"}, 0, False),
    ],
)
def test_wants_dump(rid: object, params: object, max_new: object, expected: bool) -> None:
    assert sglang_hook.wants_dump(rid, params, max_new) is expected


# --------------------------------------------------------------------------------------
# The factory SGLang calls
# --------------------------------------------------------------------------------------


@pytest.fixture
def server_env(
    monkeypatch: pytest.MonkeyPatch, api: SglangApi, shm_root: Path
) -> Iterator[dict[str, ServerInfo]]:
    info = {"info": ServerInfo(GOOD, attn_tp_rank=0, served_model_name="served/model")}
    monkeypatch.setenv("HSX_AUX_LAYERS", "1,4")
    monkeypatch.setenv("HSX_DUMP_ROOT", str(shm_root))
    monkeypatch.delenv("HSX_MODEL_NAME", raising=False)
    monkeypatch.setattr(sglang_hook, "_read_server_info", lambda path: info["info"])
    monkeypatch.setattr(sglang_hook, "_load_sglang_api", lambda path: api)
    # The dev environment has no sglang; the factory refuses any other version.
    newest = sglang_hook.SGLANG_RANGE.versions[-1]
    monkeypatch.setattr(sglang_hook, "installed_sglang_version", lambda: newest)
    yield info
    state = sglang_hook._Installed.state
    if state is not None and state.background is not None:
        state.background.close(10.0)
    sglang_hook._Installed.state = None


def test_factory_installs_once(server_env: dict[str, ServerInfo], api: SglangApi) -> None:
    hook = sglang_hook.hsx_hook_factory({})
    assert hook(nn.Identity(), (torch.zeros(1),), torch.zeros(1)) is None
    state = sglang_hook._Installed.state
    assert state is not None and state.writer
    assert state.dumper.model == "served/model"
    assert state.config.aux_layers == LAYERS
    assert sglang_hook.hsx_hook_factory(None) is hook
    assert sglang_hook._Installed.state is state
    assert api.req_cls("r1", [1], params()).return_hidden_states_mode == FULL


def test_factory_starts_background_writers(
    server_env: dict[str, ServerInfo], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HSX_WRITER_THREADS", "3")
    monkeypatch.setenv("HSX_WRITE_QUEUE_MB", "64")
    sglang_hook.hsx_hook_factory({})
    state = sglang_hook._Installed.state
    assert state is not None and state.background is not None
    assert state.dumper.sink is state.background
    assert state.background.alive == 3 and state.background.queue_bytes == 64 << 20


@pytest.mark.parametrize(("env", "rank"), [({"HSX_WRITER_THREADS": "0"}, 0), ({}, 1)])
def test_factory_without_background_writers(
    server_env: dict[str, ServerInfo],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    rank: int,
) -> None:
    """HSX_WRITER_THREADS=0 writes on the scheduler thread; a non-writing rank gets none."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    server_env["info"] = ServerInfo(GOOD, attn_tp_rank=rank, served_model_name=None)
    sglang_hook.hsx_hook_factory({})
    state = sglang_hook._Installed.state
    assert state is not None and state.background is None and state.dumper.sink is None


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("HSX_WRITER_THREADS", "many", "not an integer"),
        ("HSX_WRITER_THREADS", "-1", "out of range"),
        ("HSX_WRITE_QUEUE_MB", "0", "out of range"),
        ("HSX_DEVICE_STACK", "maybe", "not a switch"),
    ],
)
def test_factory_refuses_bad_writer_settings(
    server_env: dict[str, ServerInfo],
    monkeypatch: pytest.MonkeyPatch,
    key: str,
    value: str,
    fragment: str,
) -> None:
    monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=fragment) as info:
        sglang_hook.hsx_hook_factory({})
    assert info.value.key == key
    assert sglang_hook._Installed.state is None


def test_factory_dp_attention_every_dp_leader_writes(
    server_env: dict[str, ServerInfo], api: SglangApi, shm_root: Path
) -> None:
    """tp8/dp8 (attention-TP size 1): every rank is its DP group's attention-TP rank 0 and
    writes the requests the DP controller sent it."""
    dp8 = dataclasses.replace(GOOD, attn_dp_size=8, attn_tp_size=1)
    server_env["info"] = ServerInfo(dp8, attn_tp_rank=0, served_model_name=None)
    sglang_hook.hsx_hook_factory({})
    state = sglang_hook._Installed.state
    assert state is not None and state.writer and state.background is not None
    runner = api.runner_cls(CausalLM())
    x = torch.randn(3, H)
    run_pass(api, runner, [api.req_cls("r1", [1, 2, 3], params())], [(0, 3)], x)
    np.testing.assert_array_equal(dump_rows(shm_root, "r1", 3, model=""), reference_rows(x))


def test_factory_refuses_padded_dp_attention(server_env: dict[str, ServerInfo]) -> None:
    padded = dataclasses.replace(GOOD, attn_dp_size=2, attn_tp_size=4)
    server_env["info"] = ServerInfo(padded, attn_tp_rank=0, served_model_name=None)
    with pytest.raises(ConfigError, match="attention-TP size 4"):
        sglang_hook.hsx_hook_factory({})
    assert sglang_hook._Installed.state is None


def test_factory_rank_and_model_name(
    server_env: dict[str, ServerInfo], monkeypatch: pytest.MonkeyPatch
) -> None:
    server_env["info"] = ServerInfo(GOOD, attn_tp_rank=3, served_model_name=None)
    monkeypatch.setenv("HSX_MODEL_NAME", "my-model")
    sglang_hook.hsx_hook_factory({})
    state = sglang_hook._Installed.state
    assert state is not None and not state.writer and state.dumper.model == "my-model"


def test_factory_refuses_bad_settings(server_env: dict[str, ServerInfo], api: SglangApi) -> None:
    server_env["info"] = ServerInfo(
        dataclasses.replace(GOOD, radix_cache=True),
        attn_tp_rank=0,
        served_model_name=None,
    )
    with pytest.raises(ConfigError, match="--disable-radix-cache"):
        sglang_hook.hsx_hook_factory({})
    assert sglang_hook._Installed.state is None
    assert api.req_cls("r1", [1], params()).return_hidden_states_mode == NULL


def test_factory_refuses_config_and_bad_env(
    server_env: dict[str, ServerInfo], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=re.escape('"config": {}')):
        sglang_hook.hsx_hook_factory({"aux_layers": [1, 4]})
    monkeypatch.setenv("HSX_AUX_LAYERS", "4,1")
    with pytest.raises(ConfigError, match="ascending"):
        sglang_hook.hsx_hook_factory({})
    assert sglang_hook._Installed.state is None


def test_factory_refuses_other_sglang(
    server_env: dict[str, ServerInfo], monkeypatch: pytest.MonkeyPatch, api: SglangApi
) -> None:
    monkeypatch.setattr(sglang_hook, "installed_sglang_version", lambda: "0.6.0")
    monkeypatch.delenv("HSX_ALLOW_SGLANG_VERSION", raising=False)
    with pytest.raises(ConfigError) as refused:
        sglang_hook.hsx_hook_factory({})
    message = str(refused.value)
    # One line naming the range (the one table: hsx_async.server.engine_versions).
    assert message == (
        "the hsx hook supports sglang 0.5.14 to 0.5.23, but sglang 0.6.0 is installed: "
        "install one of them, or set HSX_ALLOW_SGLANG_VERSION=0.6.0 to run it anyway (after "
        "checking its dumps)"
    )
    assert sglang_hook._Installed.state is None
    assert api.req_cls("r1", [1], params()).return_hidden_states_mode == NULL
    # An override naming another version does not cover this one.
    monkeypatch.setenv("HSX_ALLOW_SGLANG_VERSION", "0.5.24")
    with pytest.raises(ConfigError, match=re.escape("HSX_ALLOW_SGLANG_VERSION=0.6.0")):
        sglang_hook.hsx_hook_factory({})
    monkeypatch.setattr(sglang_hook, "installed_sglang_version", lambda: None)
    with pytest.raises(ConfigError, match="sglang unknown is installed"):
        sglang_hook.hsx_hook_factory({})


def test_factory_runs_other_sglang_when_allowed(
    server_env: dict[str, ServerInfo],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(sglang_hook, "installed_sglang_version", lambda: "0.6.0")
    monkeypatch.setenv("HSX_ALLOW_SGLANG_VERSION", "0.6.0")
    with caplog.at_level(logging.WARNING, logger=sglang_hook.__name__):
        sglang_hook.hsx_hook_factory({})
    assert "supports sglang 0.5.14 to 0.5.23, running sglang 0.6.0 (allowed by" in caplog.text
    state = sglang_hook._Installed.state
    assert state is not None and state.config.server == "sglang 0.6.0"


def test_the_hook_sglang_loads_does_not_import_the_drift_checker() -> None:
    """The checker is dev-only: a scheduler process importing the hook never loads it."""
    code = (
        "import sys, hsx_async.server.sglang_hook; "
        "print('hsx_async.server.sglang.drift' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "False"


def test_checked_version_needs_no_override(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=sglang_hook.__name__):
        for version in sglang_hook.SGLANG_RANGE.versions:
            assert sglang_hook.check_sglang_version(version, {}) == version
    assert not caplog.records


@pytest.mark.parametrize("version", ["0.5.13.post1", "0.5.24", "0.5.23rc1", ""])
def test_a_release_outside_the_range_is_refused(version: str) -> None:
    """0.5.13.post1 fails the drift check (no runtime_context, no
    --disable-prefill-cuda-graph), newer ones are unchecked: refused in one line."""
    with pytest.raises(ConfigError) as refused:
        sglang_hook.check_sglang_version(version or None, {})
    message = str(refused.value)
    assert "\n" not in message and "supports sglang 0.5.14 to 0.5.23" in message
    assert f"sglang {version or 'unknown'} is installed" in message


# --------------------------------------------------------------------------------------
# deploy/sglang/launch.sh
# --------------------------------------------------------------------------------------

FAKE_LAUNCHER = textwrap.dedent(
    """
    import json, os, sys
    with open(os.environ["HSX_TEST_CAPTURE"], "w") as fh:
        json.dump({"argv": sys.argv[1:],
                   "env": {k: v for k, v in os.environ.items() if k.startswith("HSX_")}}, fh)
    """
)


def run_launch(
    tmp_path: Path, env: dict[str, str], *args: str, version: str = "0.5.23"
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """launch.sh against a fake ``sglang`` distribution of ``version``."""
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True, exist_ok=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "launch_server.py").write_text(FAKE_LAUNCHER)
    for old in fake.glob("sglang-*.dist-info"):
        shutil.rmtree(old)
    dist = fake / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    capture = tmp_path / "capture.json"
    capture.unlink(missing_ok=True)
    full_env = {
        "PATH": os.environ["PATH"],
        "HSX_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join([str(fake), str(REPO)]),
        "HSX_TEST_CAPTURE": str(capture),
        **env,
    }
    proc = subprocess.run(
        ["bash", str(LAUNCH), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc, json.loads(capture.read_text()) if capture.exists() else None


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_launch_script_runs_sglang_with_every_required_flag(tmp_path: Path) -> None:
    proc, got = run_launch(
        tmp_path,
        {"HSX_AUX_LAYERS": "2,30,58", "HSX_TP_SIZE": "8", "HSX_CHUNKED_PREFILL_SIZE": "4096"},
        "/models/m",
        "--mem-fraction-static",
        "0.8",
    )
    assert proc.returncode == 0, proc.stderr
    assert got is not None
    argv = got["argv"]
    for flag in (
        "--disable-radix-cache",
        "--enable-return-aux-hidden-states",
        "--disable-prefill-cuda-graph",
    ):
        assert flag in argv
    assert flag_value(argv, "--speculative-algorithm") == "EAGLE3"
    assert flag_value(argv, "--model-path") == "/models/m"
    assert flag_value(argv, "--tp-size") == "8"
    assert flag_value(argv, "--chunked-prefill-size") == "4096"
    assert json.loads(flag_value(argv, "--forward-hooks")) == FORWARD_HOOK_SPEC
    assert argv[-2:] == ["--mem-fraction-static", "0.8"]
    assert "--return-aux-hidden-state-layer-ids" not in argv
    assert got["env"]["HSX_AUX_LAYERS"] == "2,30,58"
    assert got["env"]["HSX_DUMP_ROOT"] == "/dev/shm/hsx"


@pytest.mark.parametrize("version", ["0.5.14", "0.5.22"])
def test_launch_script_before_0_5_23_asks_for_no_capture_mode(tmp_path: Path, version: str) -> None:
    """No --enable-return-aux-hidden-states there (the hook captures itself), and no
    speculative algorithm (it would load a draft model)."""
    proc, got = run_launch(tmp_path, {"HSX_AUX_LAYERS": "2,30,58"}, "/models/m", version=version)
    assert proc.returncode == 0, proc.stderr
    assert got is not None
    argv = got["argv"]
    assert "--enable-return-aux-hidden-states" not in argv
    assert "--speculative-algorithm" not in argv
    assert "" not in argv
    for flag in ("--disable-radix-cache", "--disable-prefill-cuda-graph", "--forward-hooks"):
        assert flag in argv
    assert flag_value(argv, "--model-path") == "/models/m"


def test_launch_script_defaults(tmp_path: Path) -> None:
    proc, got = run_launch(tmp_path, {"HSX_AUX_LAYERS": "3"}, "/models/m")
    assert proc.returncode == 0, proc.stderr
    assert got is not None
    argv = got["argv"]
    assert "--chunked-prefill-size" not in argv
    assert (flag_value(argv, "--tp-size"), flag_value(argv, "--port")) == ("1", "30000")


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({}, ["/models/m"], "set HSX_AUX_LAYERS"),
        ({"HSX_AUX_LAYERS": "30,2"}, ["/models/m"], "not strictly ascending"),
        ({"HSX_AUX_LAYERS": "2", "HSX_DUMP_ROOT": "rel"}, ["/models/m"], "is relative"),
        ({"HSX_AUX_LAYERS": "2"}, [], "usage:"),
    ],
)
def test_launch_script_refuses_before_starting_sglang(
    tmp_path: Path, env: dict[str, str], args: list[str], message: str
) -> None:
    proc, got = run_launch(tmp_path, env, *args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert got is None
