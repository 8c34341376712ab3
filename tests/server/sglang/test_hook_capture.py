"""The hook's own capture path (SGLang 0.5.14-0.5.22: no ``--enable-return-aux-hidden-states``,
no kept post-norm final state), driven through stand-ins shaped like 0.5.14's classes: a
``Req`` without ``return_hidden_states_mode``, a model whose aux capture is off until
``set_eagle3_layers_to_capture`` turns it on, a ``LogitsProcessor`` that stores the aux rows
only in full capture mode and drops its ``hidden_states`` argument, and the overlap
scheduler's batch copy without ``prefix_lens``/``extend_lens``. The rows dumped must be
Hugging Face's ``hidden_states[k]`` and the output of the final norm, as on 0.5.23.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from hsx_async.errors import ConfigError
from hsx_async.server.dumper import PrefillDumper
from hsx_async.server.hook_core import DEFAULT_MAX_OPEN, HookConfig
from hsx_async.server.sglang import capture, releases
from hsx_async.server.sglang import hook as sglang_hook
from hsx_async.server.sglang.hook import HookState, SglangApi, install, uninstall
from tests.server.sglang.standins import (
    FULL,
    LAYERS,
    N_LAYERS,
    NS,
    NULL,
    Event,
    H,
    RecordingD2h,
    Stack,
    final_norm,
    make_api,
    params,
    reference_rows,
)
from tests.server.sglang.test_sglang_hook import dump_rows, settle

LAST = "LAST"


class HookPathLM(nn.Module):
    """A CausalLM as 0.5.14's Llama: capture off until set_eagle3_layers_to_capture."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Stack()
        self.model.layers_to_capture = []
        self.capture_aux_hidden_states = False
        self.setter_calls: list[object] = []

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        self.setter_calls.append(layer_ids)
        self.capture_aux_hidden_states = True
        self.model.layers_to_capture = [2, N_LAYERS // 2, N_LAYERS - 3]


def make_hook_api(d2h_calls: list[torch.Tensor]) -> SglangApi:  # noqa: C901 (stand-in classes)
    """Fresh 0.5.14-shaped stand-ins per test (patches never leak)."""

    class Req(make_api([]).req_cls):  # type: ignore[misc]
        """0.5.14's: no return_hidden_states_mode, no discard_output_reason."""

        def __init__(self, rid: object, origin_input_ids: list[int], sampling_params: Any) -> None:
            super().__init__(rid, origin_input_ids, sampling_params)
            del self.return_hidden_states_mode, self.discard_output_reason

    class Processor:
        def process_batch_result_prefill(self, batch: Any, result: Any) -> None:
            for req in batch.reqs:
                if req.inflight_middle_chunks > 0:
                    req.inflight_middle_chunks -= 1
                else:
                    req.finished_reason = "length"

    class Result:
        def __init__(self, logits_output: Any) -> None:
            self.logits_output = logits_output
            self.extend_input_len_per_req = None  # (0.5.14: None without logprobs)
            self.copy_done = Event()
            self.can_run_cuda_graph = False

        def copy_to_cpu(self, return_logprob: bool, return_hidden_states: bool = True) -> None:
            out = self.logits_output
            if return_hidden_states and out.hidden_states is not None:
                out.hidden_states = out.hidden_states.to("cpu", non_blocking=True)

    class LogitsProcessor:
        """0.5.14's: full mode stores cat(aux) (or the final state without aux), a
        pre-norm state replaces it; ``hidden_states`` itself is not kept."""

        def forward(  # noqa: PLR0917 (SGLang's signature)
            self,
            input_ids: Any,
            hidden_states: torch.Tensor,
            lm_head: Any,
            logits_metadata: Any,
            aux_hidden_states: list[torch.Tensor] | None = None,
            hidden_states_before_norm: torch.Tensor | None = None,
        ) -> SimpleNamespace:
            stored = None
            if logits_metadata.capture_hidden_mode == FULL:
                stored = (
                    hidden_states
                    if aux_hidden_states is None
                    else torch.cat(aux_hidden_states, dim=-1)
                )
                if hidden_states_before_norm is not None:
                    stored = hidden_states_before_norm
            return SimpleNamespace(next_token_logits=hidden_states[-1:], hidden_states=stored)

    class Runner:
        def __init__(self, model: HookPathLM) -> None:
            self.model: Any = model
            self.logits_processor = LogitsProcessor()

        def forward(self, forward_batch: Any) -> SimpleNamespace:
            x = forward_batch.input
            lm = self.model
            aux = []
            for i, layer in enumerate(lm.model.layers):
                if lm.capture_aux_hidden_states and i in lm.model.layers_to_capture:
                    aux.append(x)
                x = layer(x)
            out = self.logits_processor.forward(
                None, final_norm(x), None, forward_batch, aux or None,
                forward_batch.before_norm,
            )  # fmt: skip
            return SimpleNamespace(logits_output=out)

    d2h = RecordingD2h(d2h_calls)
    return SglangApi(Req, Processor, Result, Runner, FULL, d2h, LogitsProcessor, "hook")


@pytest.fixture
def api() -> Iterator[SglangApi]:
    """The stand-ins (``api.async_d2h.calls``: what was queued to the host), the hook's
    patches undone after the test."""
    hook_api = make_hook_api([])
    yield hook_api
    uninstall(hook_api)


def hook_state(root: Path, *, writer: bool = True) -> HookState:
    cfg = HookConfig(dump_root=root, aux_layers=LAYERS, model=None, server="sglang 0.5.14")
    return HookState(
        config=cfg, dumper=PrefillDumper(cfg, model="tiny"), writer=writer, path="hook"
    )


@pytest.fixture
def state(api: SglangApi, shm_root: Path) -> HookState:
    st = hook_state(shm_root)
    install(st, api)
    return st


def forward_batch(reqs: list[Any], spans: list[tuple[int, int]], x: torch.Tensor) -> Any:
    return SimpleNamespace(
        input=x,
        rids=[r.rid for r in reqs],
        capture_hidden_mode=NULL,
        extend_prefix_lens_cpu=[s for s, _ in spans],
        extend_seq_lens_cpu=[n for _, n in spans],
        before_norm=None,
    )


def hook_pass(
    api: SglangApi,
    runner: Any,
    x: torch.Tensor,
    *planned: tuple[Any, int, int],
    overlap_copy: bool = True,
    before_norm: torch.Tensor | None = None,
) -> tuple[Any, Any]:
    """One prefill pass and its result processing. ``overlap_copy``: the batch the result
    processor gets has no prefix/extend lengths (0.5.14's overlap scheduler). ``planned``:
    each request with its (start, rows) in the pass."""
    reqs = [req for req, _, _ in planned]
    spans = [(start, rows) for _, start, rows in planned]
    fb = forward_batch(reqs, spans, x)
    fb.before_norm = before_norm
    out = runner.forward(fb).logits_output
    result = api.result_cls(out)
    # SGLang asks for hidden states only where a request returns them: none here.
    result.copy_to_cpu(False, return_hidden_states=False)
    lens = None if overlap_copy else [n for _, n in spans]
    starts = None if overlap_copy else [s for s, _ in spans]
    batch = SimpleNamespace(reqs=reqs, prefix_lens=starts, extend_lens=lens)
    api.processor_cls().process_batch_result_prefill(batch, result)
    settle()
    return fb, result


@pytest.mark.parametrize("overlap_copy", [True, False], ids=["overlap-copy", "full-batch"])
def test_the_hook_captures_what_the_server_flag_would(
    api: SglangApi, state: HookState, shm_root: Path, overlap_copy: bool
) -> None:
    """Two marked requests (one split over two passes) beside a plain one: each dump is
    the reference rows (aux k = hidden_states[k], final = the norm's output)."""
    model = HookPathLM()
    runner = api.runner_cls(model)
    x1, x2, xp = torch.randn(5, H), torch.randn(3, H), torch.randn(2, H)
    r1 = api.req_cls("r1", list(range(5)), params())
    r2 = api.req_cls("r2", [1, 2, 3], params())
    plain = api.req_cls("p", [1, 2], params(ns=None, max_new_tokens=4))
    assert not hasattr(r1, "return_hidden_states_mode") and not r1.return_hidden_states
    assert list(state.marked) == ["r1", "r2"]
    r1.inflight_middle_chunks = 1
    fb, _ = hook_pass(
        api, runner, torch.cat([x1[:3], xp]), (r1, 0, 3), (plain, 0, 2),
        overlap_copy=overlap_copy,
    )  # fmt: skip
    assert model.setter_calls == [None], "SGLang's own setter turns capture on, once"
    assert model.capture_aux_hidden_states and model.model.layers_to_capture == list(LAYERS)
    assert fb.capture_hidden_mode == FULL
    assert state.graph_layers == (), "the graphs were recorded capturing nothing"
    hook_pass(
        api, runner, torch.cat([x1[3:], x2]), (r1, 3, 2), (r2, 0, 3),
        overlap_copy=overlap_copy,
    )  # fmt: skip
    np.testing.assert_array_equal(dump_rows(shm_root, "r1", 5), reference_rows(x1))
    assert not state.marked, "a request's last chunk forgets it"
    np.testing.assert_array_equal(dump_rows(shm_root, "r2", 3), reference_rows(x2))
    assert not (shm_root / NS / "p").exists()


def test_a_pass_without_marked_requests_is_left_as_it_is(
    api: SglangApi, state: HookState, shm_root: Path
) -> None:
    runner = api.runner_cls(HookPathLM())
    plain = api.req_cls("p", [1, 2, 3], params(ns=None, max_new_tokens=4))
    fb, result = hook_pass(api, runner, torch.randn(3, H), (plain, 0, 3))
    assert fb.capture_hidden_mode == NULL
    assert result.logits_output.hidden_states is None
    assert getattr(result.logits_output, capture.FINAL_STATE_ATTR, None) is None
    assert not (shm_root / NS).exists()


def test_a_pre_norm_final_state_is_never_dumped(
    api: SglangApi, state: HookState, shm_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model handing the processor ``hidden_states_before_norm``: SGLang stores that in
    place of the aux rows; the hook keeps no final state and refuses the pass."""
    runner = api.runner_cls(HookPathLM())
    req = api.req_cls("r1", [1, 2, 3], params())
    x = torch.randn(3, H)
    with caplog.at_level(logging.WARNING):
        _, result = hook_pass(api, runner, x, (req, 0, 3), before_norm=x)
    assert getattr(result.logits_output, capture.FINAL_STATE_ATTR, None) is None
    assert "no dump for rid r1" in caplog.text and "post-norm final" in caplog.text
    assert not (shm_root / NS / "r1" / "meta.json").exists()


def test_the_copy_takes_the_aux_rows_sglang_does_not_ask_for(
    api: SglangApi, state: HookState
) -> None:
    """SGLang's copy_to_cpu is told return_hidden_states=False (no request returns them):
    the hook queues both the aux rows and the final state."""
    runner = api.runner_cls(HookPathLM())
    req = api.req_cls("r1", [1, 2, 3], params())
    fb = forward_batch([req], [(0, 3)], torch.randn(3, H))
    out = runner.forward(fb).logits_output
    aux, final = out.hidden_states, getattr(out, capture.FINAL_STATE_ATTR)
    api.result_cls(out).copy_to_cpu(False, return_hidden_states=False)
    assert isinstance(api.async_d2h, RecordingD2h)
    assert [t.data_ptr() for t in api.async_d2h.calls] == [aux.data_ptr(), final.data_ptr()]


def test_a_non_writing_rank_captures_too(api: SglangApi, shm_root: Path) -> None:
    """Every rank runs the marked passes in full capture (the forward is the same on each
    TP rank); only the writing rank writes."""
    st = hook_state(shm_root, writer=False)
    install(st, api)
    runner = api.runner_cls(HookPathLM())
    req = api.req_cls("r1", [1, 2], params())
    fb, result = hook_pass(api, runner, torch.randn(2, H), (req, 0, 2))
    assert fb.capture_hidden_mode == FULL
    assert getattr(result.logits_output, capture.FINAL_STATE_ATTR) is not None
    assert not (shm_root / NS).exists()


def test_marked_rids_are_bounded(shm_root: Path) -> None:
    st = hook_state(shm_root)
    for i in range(3 * DEFAULT_MAX_OPEN):
        st.note_marked(f"r{i}")
    st.note_marked(7)
    assert len(st.marked) == 2 * DEFAULT_MAX_OPEN
    assert f"r{3 * DEFAULT_MAX_OPEN - 1}" in st.marked and "r0" not in st.marked


def test_install_refuses_a_hook_path_without_the_logits_processor(
    api: SglangApi, shm_root: Path
) -> None:
    import dataclasses

    with pytest.raises(ConfigError, match="LogitsProcessor"):
        install(hook_state(shm_root), dataclasses.replace(api, logits_cls=None))


# --------------------------------------------------------------------------------------
# capture.py's pieces
# --------------------------------------------------------------------------------------


def test_enable_model_capture_keeps_a_capture_already_on() -> None:
    model = HookPathLM()
    model.set_eagle3_layers_to_capture([1])
    assert capture.enable_model_capture(model) is True
    assert model.setter_calls == [[1]], "not called again"


def test_a_model_without_eagle3_capture_is_refused() -> None:
    with pytest.raises(ConfigError, match="has no set_eagle3_layers_to_capture") as info:
        capture.enable_model_capture(nn.Linear(2, 2))
    assert info.value.key == "HSX_AUX_LAYERS"


def test_a_setter_that_turns_nothing_on_is_refused() -> None:
    class Broken(HookPathLM):
        def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
            self.setter_calls.append(layer_ids)

    with pytest.raises(ConfigError, match="left no module with capture_aux_hidden_states on"):
        capture.enable_model_capture(Broken())


@pytest.mark.parametrize(
    ("rids", "expected"),
    [(["a", "m"], True), (["a"], False), ([], False), (None, False), ([7], False)],
)
def test_mark_full_capture(rids: list[object] | None, expected: bool) -> None:
    batch = SimpleNamespace(rids=rids, capture_hidden_mode=NULL)
    assert capture.mark_full_capture(batch, {"m": None}, FULL) is expected
    assert batch.capture_hidden_mode == (FULL if expected else NULL)


@pytest.mark.parametrize(
    ("starts", "rows", "expected"),
    [([0, 3], [3, 2], ((0, 3), (3, 2))), (None, [1], None), ([0], None, None), ([0], [1, 2], None)],
)
def test_pass_layout(starts: Any, rows: Any, expected: Any) -> None:
    batch = SimpleNamespace(extend_prefix_lens_cpu=starts, extend_seq_lens_cpu=rows)
    assert capture.pass_layout(batch) == expected


def test_the_logits_wrapper_keeps_the_final_state_only_beside_full_aux_rows() -> None:
    def original(self: Any, input_ids: Any, hs: Any, lm: Any, meta: Any, *a: Any, **k: Any) -> Any:
        aux = a[0] if a else k.get("aux_hidden_states")
        return SimpleNamespace(hidden_states=None if aux is None else torch.cat(aux, -1))

    wrapped = capture.wrap_logits_forward(original, FULL)
    final, aux = torch.randn(2, H), [torch.randn(2, H)]
    full = SimpleNamespace(capture_hidden_mode=FULL)
    kept = wrapped(None, None, final, None, full, aux)
    assert getattr(kept, capture.FINAL_STATE_ATTR) is final
    assert wrapped(None, None, final, None, full, aux_hidden_states=aux).last_hidden_states is final
    for out in (
        wrapped(None, None, final, None, SimpleNamespace(capture_hidden_mode=LAST), aux),
        wrapped(None, None, final, None, full),
        wrapped(None, None, final, None, full, aux, final),
        wrapped(None, None, final, None, full, aux, hidden_states_before_norm=final),
    ):
        assert not hasattr(out, capture.FINAL_STATE_ATTR)


# --------------------------------------------------------------------------------------
# releases.py
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "path"),
    [
        ("0.5.14", "hook"),
        ("0.5.15.post1", "hook"),
        ("0.5.22", "hook"),
        ("0.5.23", "server"),
        ("0.5.23+cpu", "server"),
        ("0.6.0", "server"),
        ("0.5.23rc1", "server"),
    ],
)
def test_capture_path_by_release(version: str, path: str) -> None:
    assert releases.capture_path(version) == path
    flags = releases.capture_flags(releases.capture_path(version))
    assert ("--enable-return-aux-hidden-states" in flags) is (path == "server")


def test_launch_capture_flags_without_sglang() -> None:
    assert sglang_hook.launch_capture_flags(None) == ()
    assert sglang_hook.launch_capture_flags("0.5.14") == ()
    assert sglang_hook.launch_capture_flags("0.5.23") == releases.SERVER_CAPTURE_FLAGS


FLAT = SimpleNamespace(
    disable_radix_cache=True,
    enable_two_batch_overlap=False,
    moe_a2a_backend="none",
    disaggregation_mode=SimpleNamespace(value="null"),
    served_model_name="m",
    speculative_algorithm=None,
)


def test_flat_settings_are_read_from_server_args() -> None:
    raw = releases.read_flat_settings(FLAT)
    assert raw == releases.RawSettings(
        radix_cache=False,
        two_batch_overlap=False,
        moe_a2a_backend="none",
        disaggregation_mode="null",
        served_model_name="m",
        speculative_algorithm=None,
    )


@pytest.mark.parametrize("server_capture", [True, False])
def test_grouped_settings_are_read_from_the_runtime_context(server_capture: bool) -> None:
    features = SimpleNamespace(
        aux_hidden_state_capture="eagle3", return_aux_hidden_state_layer_ids=[1, 2]
    )
    rc = SimpleNamespace(
        get_exec=lambda: SimpleNamespace(
            features=features,
            overlap=SimpleNamespace(enable_two_batch_overlap=True),
            moe=SimpleNamespace(moe_a2a_backend="deepep"),
        ),
        get_memory=lambda: SimpleNamespace(disable_radix_cache=False),
        get_disagg=lambda: SimpleNamespace(disaggregation_mode="prefill"),
        get_serving=lambda: SimpleNamespace(served_model_name=None),
        get_spec=lambda: SimpleNamespace(speculative_algorithm="EAGLE3"),
    )
    raw = releases.read_grouped_settings(rc, server_capture=server_capture)
    assert (raw.radix_cache, raw.two_batch_overlap, raw.moe_a2a_backend) == (True, True, "deepep")
    assert (raw.disaggregation_mode, raw.served_model_name) == ("prefill", None)
    if server_capture:
        assert (raw.aux_capture, raw.aux_layer_ids_flag, raw.speculative_algorithm) == (
            "eagle3",
            (1, 2),
            None,
        )
    else:
        assert (raw.aux_capture, raw.aux_layer_ids_flag, raw.speculative_algorithm) == (
            None,
            None,
            "EAGLE3",
        )


def test_async_d2h_falls_back_to_sglangs_own_copy_before_0_5_21() -> None:
    """Without sglang (or before 0.5.21, which has no async_d2h): copy_to_cpu's own
    ``.to("cpu", non_blocking=True)``; a host tensor stays as it is."""
    assert releases.load_async_d2h() is releases.host_copy
    t = torch.randn(2, 2)
    assert releases.host_copy(t) is t


# --------------------------------------------------------------------------------------
# The factory on a release of the hook's path
# --------------------------------------------------------------------------------------


def test_the_factory_takes_the_hook_path_on_0_5_14(
    monkeypatch: pytest.MonkeyPatch, api: SglangApi, shm_root: Path
) -> None:
    import dataclasses

    from tests.server.sglang.test_settings import GOOD

    asked: list[str] = []
    settings = dataclasses.replace(GOOD, capture="hook", aux_capture=None)
    info = sglang_hook.ServerInfo(settings, attn_tp_rank=0, served_model_name=None)
    monkeypatch.setenv("HSX_AUX_LAYERS", "1,4")
    monkeypatch.setenv("HSX_DUMP_ROOT", str(shm_root))
    monkeypatch.setenv("HSX_WRITER_THREADS", "0")
    monkeypatch.setattr(sglang_hook, "installed_sglang_version", lambda: "0.5.14")

    def read_info(path: str) -> sglang_hook.ServerInfo:
        asked.append(path)
        return info

    def load_api(path: str) -> SglangApi:
        asked.append(path)
        return api

    monkeypatch.setattr(sglang_hook, "_read_server_info", read_info)
    monkeypatch.setattr(sglang_hook, "_load_sglang_api", load_api)
    try:
        sglang_hook.hsx_hook_factory({})
        state = sglang_hook._Installed.state
        assert asked == ["hook", "hook"]
        assert state is not None and state.path == "hook"
        assert hasattr(api.logits_cls.__dict__["forward"], "__hsx_original__")
        runner = api.runner_cls(HookPathLM())
        x = torch.randn(4, H)
        hook_pass(api, runner, x, (api.req_cls("r1", [1, 2, 3, 4], params()), 0, 4))
        np.testing.assert_array_equal(dump_rows(shm_root, "r1", 4, model=""), reference_rows(x))
    finally:
        sglang_hook._Installed.state = None
