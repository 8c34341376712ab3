"""The hsx hook inside SGLang (the releases of :data:`SGLANG_RANGE`): thin glue between
SGLang's scheduler and the engine interface every hook implements
(``hsx_async/server/README.md``).

How it gets loaded: SGLang runs its schedulers (one per tensor-parallel rank) in spawned
processes, so a patch applied in the launcher would be lost. ``--forward-hooks`` names
:func:`hsx_hook_factory`; SGLang imports and calls it inside every rank's scheduler process
while it builds the model runner (``register_forward_hooks`` in
``model_executor/hook_manager.py``, called after CUDA-graph capture). The factory checks the
server's settings, then patches four methods in that process (five on the releases before
0.5.23, where the hook captures the aux layers and the final state itself:
:mod:`hsx_async.server.sglang.releases` says what differs per release,
:mod:`hsx_async.server.sglang.capture` how the hook's own capture works; the bullets below
are 0.5.23's path):

- ``Req.__init__``: a marked request (valid ``custom_params.hsx_ns`` and rid,
  ``max_new_tokens=0``) asks for full hidden-state capture, so its batches copy the hidden
  rows to the host right behind the forward. Its ``return_hidden_states`` stays False, so
  nothing goes into the JSON response.
- ``GenerationBatchResult.copy_to_cpu``: the final (post-norm) hidden state, which SGLang
  keeps next to the aux layers but does not copy, is copied along with them (on a GPU, by
  default: both laid out as ``[T, L, H]`` on the device, then one copy; the default per
  model dtype and why are :data:`~hsx_async.server.hook_core.DEVICE_STACK_BY_DTYPE`,
  ``HSX_DEVICE_STACK`` overrides it). When every request of the pass asks for one FP8
  storage (``hsx_dtype``, ``hsx_quantized``), the rows are quantized on the device instead
  and only the FP8 sections are copied (:func:`encode_to_host`); other FP8 requests are
  quantized by the writer threads, and an unusable request is dumped as bfloat16 (logged
  once). A model served in float32 (or float16) has its rows rounded to bfloat16 on the
  device before the copy (half the bytes of float32 cross), or, where the rows are already
  on the host (a CPU server), by the writer threads: never on the scheduler thread (issue
  28).
- ``ModelRunner.forward``: notes the pass's rids (``ForwardBatch.rids``) for the copy; and
  before the first forward, the decoder stack's ``layers_to_capture`` is set to
  ``HSX_AUX_LAYERS`` (layer k = the residual stream entering layer k = Hugging Face
  ``hidden_states[k]``), whatever numbering the model's ``set_eagle3_layers_to_capture``
  uses; and the page-locked host memory the passes' copies will take is made ready
  (:mod:`hsx_async.server.pinned`, ``HSX_PASS_ROWS``), so that no pass grows PyTorch's
  pinned cache on the scheduler thread. That first forward is SGLang's own
  warm-up request, before any client's.
- ``SchedulerBatchResultProcessor.process_batch_result_prefill``: before SGLang consumes a
  prefill result, attention-TP rank 0 (of each DP group, under DP attention) hands the
  pass to :class:`~hsx_async.server.dumper.PrefillDumper`, which plans one part per
  marked request and passes the writes, with a reference to the pass's host rows, to the
  process's :class:`~hsx_async.server.hook_writer.BackgroundWriter` threads
  (``HSX_WRITER_THREADS``, ``HSX_WRITE_QUEUE_MB``): the scheduler thread does bookkeeping
  only. They write the parts in order per request and commit ``meta.json`` after the last.

SGLang is imported only inside functions: this module imports without it.
:data:`hsx_async.server.sglang.drift.SGLANG_TARGETS` lists everything the glue patches or
reads, for the drift test (that module is dev-only and not imported here).
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np
import torch

from hsx_async.errors import ConfigError, DumpError, HsxRequestError
from hsx_async.protocol import (
    BF16_STORAGE,
    Storage,
    check_aux_layers,
    check_hsx_request,
    marked_ns,
)
from hsx_async.quantize import encode_rows
from hsx_async.server.dumper import PrefillDumper
from hsx_async.server.engine_versions import ENGINE_RANGES, check_engine_version
from hsx_async.server.hook_core import (
    DEFAULT_MAX_OPEN,
    ENV_AUX_LAYERS,
    HookConfig,
    ReqView,
    request_storage,
)
from hsx_async.server.hook_writer import BackgroundWriter
from hsx_async.server.hooks import HOOKS
from hsx_async.server.pinned import PassShape, WarmResult, describe, plan_warmup, warm
from hsx_async.server.rows import BatchHidden, EncodedPass, PassRows
from hsx_async.server.sglang.capture import (
    FINAL_STATE_ATTR,
    PASS_LAYOUT_ATTR,
    enable_model_capture,
    mark_full_capture,
    wrap_logits_forward,
)
from hsx_async.server.sglang.releases import (
    CapturePath,
    capture_flags,
    capture_path,
    load_async_d2h,
    read_flat_settings,
    read_grouped_settings,
)
from hsx_async.server.sglang.settings import ServerSettings, check_server_settings

logger = logging.getLogger(__name__)

# The SGLang releases the hook accepts (the one table: hsx_async.server.engine_versions).
SGLANG_RANGE = ENGINE_RANGES["sglang"]
# Names the one other SGLang version the operator accepts (the hook refuses others).
ENV_ALLOW_SGLANG_VERSION = "HSX_ALLOW_SGLANG_VERSION"
HOOK = HOOKS["sglang"]
HOOK_FACTORY = HOOK.entry
# At interpreter exit, the writers get this long to finish the queued parts; what is left
# is abandoned (no meta.json for those requests: the client retries them).
DRAIN_AT_EXIT_S = 10.0
# The spec SGLang's --forward-hooks takes (a JSON list). The factory patches SGLang; the
# forward hook it returns does nothing, so it hangs on a module every model family has.
FORWARD_HOOK_SPEC: list[dict[str, Any]] = [
    {
        "name": "hsx",
        "target_modules": ["model.norm"],
        "hook_factory": HOOK_FACTORY,
        "config": {},
    }
]


def forward_hooks_arg() -> str:
    """The exact value of ``--forward-hooks`` (deploy/sglang/launch.sh passes it)."""
    return json.dumps(FORWARD_HOOK_SPEC, separators=(",", ":"))


def launch_capture_flags(version: str | None) -> tuple[str, ...]:
    """The flags ``deploy/sglang/launch.sh`` adds for the installed release's capture path
    (:mod:`hsx_async.server.sglang.releases`); none where no sglang is installed (the hook
    refuses that server at start-up anyway)."""
    return capture_flags(capture_path(version)) if version else ()


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_sglang_version(installed: str | None, env: Mapping[str, str]) -> str:
    """``installed``, refused unless :data:`SGLANG_RANGE` has it or the operator named
    exactly it in ``HSX_ALLOW_SGLANG_VERSION``. Another release can keep every name the glue
    reads and change what a row means (layer numbering, batch order, padding); its dumps
    would pass every client check and train a drafter on the wrong rows."""
    allow = env.get(ENV_ALLOW_SGLANG_VERSION)
    version = check_engine_version(
        "sglang", installed, allow=allow, allow_env=ENV_ALLOW_SGLANG_VERSION
    )
    if not SGLANG_RANGE.accepts(version):
        logger.warning(
            "hsx hook supports %s, running sglang %s (allowed by %s)",
            SGLANG_RANGE.describe(),
            version,
            ENV_ALLOW_SGLANG_VERSION,
        )
    return version


# --------------------------------------------------------------------------------------
# Runtime glue
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SglangApi:
    """The SGLang classes and helpers the glue patches or calls (fakes in the tests)."""

    req_cls: type[Any]
    processor_cls: type[Any]
    result_cls: type[Any]
    runner_cls: type[Any]
    full_capture: object
    async_d2h: Callable[[Any], Any]
    # The hook's own capture path (0.5.14-0.5.22): SGLang's LogitsProcessor, patched too.
    logits_cls: type[Any] | None = None
    path: CapturePath = "server"


def _load_sglang_api(path: CapturePath) -> SglangApi:
    # SGLang is imported here, never at module level: this module must import (and the
    # drift test must run) where SGLang's dependencies are not installed.
    import sglang.srt.managers.scheduler_components.batch_result_processor as brp  # noqa: PLC0415
    from sglang.srt.layers.logits_processor import LogitsProcessor  # noqa: PLC0415
    from sglang.srt.managers.schedule_batch import Req  # noqa: PLC0415
    from sglang.srt.managers.utils import GenerationBatchResult  # noqa: PLC0415
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode  # noqa: PLC0415
    from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: PLC0415

    return SglangApi(
        req_cls=Req,
        processor_cls=brp.SchedulerBatchResultProcessor,
        result_cls=GenerationBatchResult,
        runner_cls=ModelRunner,
        full_capture=CaptureHiddenMode.FULL,
        async_d2h=load_async_d2h(),
        logits_cls=LogitsProcessor if path == "hook" else None,
        path=path,
    )


@dataclass(frozen=True, slots=True)
class ServerInfo:
    settings: ServerSettings
    attn_tp_rank: int
    served_model_name: str | None


def _read_server_info(path: CapturePath) -> ServerInfo:
    import importlib.util  # noqa: PLC0415

    import sglang.srt.runtime_context as rc  # noqa: PLC0415 (see _load_sglang_api)

    if importlib.util.find_spec("sglang.srt.arg_groups.fields") is not None:  # 0.5.20 on
        raw = read_grouped_settings(rc, server_capture=path == "server")
    else:
        from sglang.srt.server_args import get_global_server_args  # noqa: PLC0415

        raw = read_flat_settings(get_global_server_args())
    parallel = rc.get_parallel()
    checked = {f.name: getattr(raw, f.name) for f in fields(raw) if f.name != "served_model_name"}
    settings = ServerSettings(
        **checked,
        attn_dp_size=int(parallel.attn_dp_size),
        attn_tp_size=int(parallel.attn_tp_size),
        pp_size=int(parallel.pp_size),
        capture=path,
    )
    return ServerInfo(settings, int(parallel.attn_tp_rank), raw.served_model_name)


@dataclass(slots=True)
class HookState:
    """The hook's state in one scheduler process."""

    config: HookConfig
    dumper: PrefillDumper
    writer: bool
    path: CapturePath = "server"
    stack: Any = None
    graph_layers: tuple[int, ...] | None = None
    # The threads that write this process's parts (None: written on the scheduler thread).
    background: BackgroundWriter | None = None
    # The storage each live marked request asked for (bfloat16 for an unusable request),
    # by rid, and the rids of the last forward: a pass whose requests are all marked for
    # one FP8 storage is quantized on the device before its copy to the host.
    storages: OrderedDict[str, Storage] = field(default_factory=OrderedDict)
    pass_rids: tuple[object, ...] | None = None
    encoded_passes: int = 0  # passes quantized on the device (tests, the log)
    encoded_storages: set[Storage] = field(default_factory=set)  # logged once each
    # Page-locked host memory as SGLang's async_d2h takes it (None: torch has none here),
    # and what the warm-up before the first pass made ready.
    allocate_pinned: Callable[[int], object] | None = None
    warmed: WarmResult | None = None
    # The hook's own capture path: the live marked requests' rids (every rank: each puts
    # the passes that carry one in full capture mode), bounded, oldest first.
    marked: OrderedDict[str, None] = field(default_factory=OrderedDict)

    @property
    def layers(self) -> int:
        return len(self.config.aux_layers) + 1

    def note_request(self, rid: object, custom_params: object) -> None:
        """A marked request was created: remember its storage (bounded, oldest first)."""
        if not isinstance(rid, str):
            return
        storage, _ = request_storage(custom_params, self.layers)
        self.storages[rid] = storage
        self.storages.move_to_end(rid)
        while len(self.storages) > 2 * DEFAULT_MAX_OPEN:
            self.storages.popitem(last=False)

    def note_marked(self, rid: object) -> None:
        """A request the hook will dump was created (the hook's own capture path)."""
        if not isinstance(rid, str):
            return
        self.marked[rid] = None
        self.marked.move_to_end(rid)
        while len(self.marked) > 2 * DEFAULT_MAX_OPEN:
            self.marked.popitem(last=False)

    def pass_storage(self) -> Storage | None:
        """The FP8 storage every request of the last forward asked for, if there is one
        (else None: the pass is copied as bfloat16, and FP8 parts quantized on the host)."""
        rids = self.pass_rids
        if not rids:
            return None
        wanted = {self.storages.get(rid) if isinstance(rid, str) else None for rid in rids}
        if len(wanted) != 1:
            return None
        storage = wanted.pop()
        return storage if storage is not None and storage.is_fp8 else None


class _Installed:
    """The process's installed hook (the factory may be called more than once)."""

    state: ClassVar[HookState | None] = None


_ORIGINAL = "__hsx_original__"
_LAYER_FLAG = "_is_layer_to_capture"


def hsx_hook_factory(config: Mapping[str, Any] | None = None) -> Callable[[Any, Any, Any], None]:
    """The ``hook_factory`` of ``--forward-hooks``: install the hook in this process."""
    if config:
        raise ConfigError(
            "--forward-hooks",
            'the hsx hook reads its settings from HSX_* variables; give it "config": {}',
        )
    if _Installed.state is None:
        version = check_sglang_version(installed_sglang_version(), os.environ)
        hook_config = HookConfig.from_env(os.environ, server=f"sglang {version}")
        path = capture_path(version)
        info = _read_server_info(path)
        check_server_settings(info.settings, hook_config)
        state = build_state(hook_config, info)
        install(state, _load_sglang_api(path))
        if state.background is not None:  # (closing twice is harmless)
            atexit.register(state.background.close, DRAIN_AT_EXIT_S)
        logger.info(
            "hsx hook installed: aux layers %s, dump root %s, %s, %s",
            list(hook_config.aux_layers),
            hook_config.dump_root,
            _describe_writing(state),
            "SGLang's aux capture"
            if path == "server"
            else "the hook's own aux capture (no --enable-return-aux-hidden-states here)",
        )
    return _forward_hook_noop


def build_state(config: HookConfig, info: ServerInfo) -> HookState:
    """The process's hook state. Attention-TP rank 0 of each DP group writes (with DP
    attention every group's leader sees only its own requests); it gets the background
    writer threads unless ``HSX_WRITER_THREADS=0``."""
    model = config.model or info.served_model_name or ""
    writer = info.attn_tp_rank == 0
    background = None
    if writer and config.writer_threads > 0:
        background = BackgroundWriter(
            config.dump_root,
            threads=config.writer_threads,
            queue_bytes=config.write_queue_bytes,
        )
    return HookState(
        config=config,
        dumper=PrefillDumper(config, model=model, sink=background, final_state=HOOK.final_state),
        writer=writer,
        path=info.settings.capture,
        background=background,
        allocate_pinned=pinned_allocator(),
    )


def pinned_allocator() -> Callable[[int], object] | None:
    """Page-locked host memory the way SGLang's ``async_d2h`` takes it (through PyTorch's
    caching host allocator), or None where torch has none (a CPU-only build)."""
    if not torch.cuda.is_available():
        return None
    return lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _describe_writing(state: HookState) -> str:
    if not state.writer:
        return "non-writing rank"
    if state.background is None:
        return "writing rank, on the scheduler thread"
    return (
        f"writing rank, {state.config.writer_threads} writer threads, "
        f"{state.config.write_queue_bytes >> 20} MiB write queue"
    )


def _forward_hook_noop(module: Any, args: Any, output: Any) -> None:
    """--forward-hooks needs a hook; the hsx hook works through the factory's patches."""


def install(state: HookState, api: SglangApi) -> None:
    """Patch ``api``'s classes for ``state``; a method already patched is left as it is."""
    plan = _patch_plan(state, api)
    missing = [f"{cls.__name__}.{name}" for cls, name, _ in plan if name not in cls.__dict__]
    if missing:
        if state.background is not None:
            state.background.close(0.0)
        raise ConfigError(
            "", f"{', '.join(missing)} missing: the hsx hook supports {SGLANG_RANGE.describe()}"
        )
    patched = False
    for cls, name, make in plan:
        current = cls.__dict__[name]
        if hasattr(current, _ORIGINAL):
            continue
        wrapper = functools.wraps(current)(make(current))
        setattr(wrapper, _ORIGINAL, current)
        setattr(cls, name, wrapper)
        patched = True
    if patched:
        _Installed.state = state
    elif state.background is not None:
        state.background.close(0.0)  # another state's patches are in place: not needed


def uninstall(api: SglangApi) -> None:
    """Restore the original methods (tests; SGLang itself never unloads a hook)."""
    for cls, name, _ in _patch_plan(None, api):
        current = cls.__dict__.get(name)
        original = getattr(current, _ORIGINAL, None)
        if original is not None:
            setattr(cls, name, original)
    _Installed.state = None


Wrapper = Callable[..., Any]


def _patch_plan(
    state: HookState | None, api: SglangApi
) -> list[tuple[type[Any], str, Callable[[Wrapper], Wrapper]]]:
    plan: list[tuple[type[Any], str, Callable[[Wrapper], Wrapper]]] = [
        (api.req_cls, "__init__", lambda orig: _wrap_req_init(orig, api, state)),
        (
            api.result_cls,
            "copy_to_cpu",
            lambda orig: _wrap_copy_to_cpu(orig, api.async_d2h, state=state),
        ),
        (api.runner_cls, "forward", lambda orig: _wrap_forward(orig, state, api.full_capture)),
        (
            api.processor_cls,
            "process_batch_result_prefill",
            lambda orig: _wrap_prefill(orig, state),
        ),
    ]
    if api.path == "hook":
        if api.logits_cls is None:
            raise ConfigError("", "the hook's own capture path needs SGLang's LogitsProcessor")
        plan.append(
            (api.logits_cls, "forward", lambda orig: wrap_logits_forward(orig, api.full_capture))
        )
    return plan


def wants_dump(rid: object, custom_params: object, max_new_tokens: object) -> bool:
    """A marked request that passes the one request rule: the hook will dump it. Others
    are served as usual; a marked one that fails the rule is reported (with the rule's
    reason) at its first prefill pass, when the dumper plans it."""
    ns = marked_ns(custom_params)
    if ns is None:
        return False
    try:
        check_hsx_request(ns, rid, max_new_tokens=max_new_tokens)
    except HsxRequestError:
        return False
    return True


def _wrap_req_init(original: Wrapper, api: SglangApi, state: HookState | None) -> Wrapper:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        params = self.sampling_params
        if wants_dump(self.rid, params.custom_params, params.max_new_tokens):
            # Full capture for this request's batches, without return_hidden_states: the
            # rows are copied to the host, but never serialised into the response.
            if api.path == "server":
                self.return_hidden_states_mode = api.full_capture
            elif state is not None:  # (the forward wrapper puts its passes in full capture)
                state.note_marked(self.rid)
            if state is not None and state.writer:
                state.note_request(self.rid, params.custom_params)

    return __init__


# Where the copy_to_cpu wrapper leaves a pass's device-encoded sections for load_hidden:
# (storage, host tensors being copied), an attribute of SGLang's GenerationBatchResult.
_ENCODED_ATTR = "_hsx_encoded"


def _wrap_copy_to_cpu(
    original: Wrapper, async_d2h: Callable[[Any], Any], *, state: HookState | None = None
) -> Wrapper:
    def copy_to_cpu(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = self.logits_output
        wanted = kwargs.get("return_hidden_states", args[1] if len(args) > 1 else True)
        final = getattr(out, FINAL_STATE_ATTR, None) if out is not None else None
        # The hook's own path: SGLang asks for no hidden states (no request of the pass
        # returns them), so it copies no aux rows: they are queued here with the final.
        own = state is not None and state.path == "hook"
        if final is not None and (wanted or own):
            # Queued before SGLang's own copies, so its copy_done event covers this one
            # too, and right behind the forward, before a later pass reuses the buffer.
            _queue_copies(self, state, async_d2h, aux_too=own and not wanted)
        return original(self, *args, **kwargs)

    return copy_to_cpu


def _queue_copies(
    result: Any, state: HookState | None, async_d2h: Callable[[Any], Any], *, aux_too: bool = False
) -> None:
    if _copy_encoded(result, state, async_d2h):
        return
    out = result.logits_output
    stacked = None
    on_device = _on_accelerator(out.last_hidden_states)
    if on_device and _stacks(state, out.last_hidden_states.dtype):
        stacked = stack_to_host(out.hidden_states, out.last_hidden_states, async_d2h)
    if stacked is not None:
        out.hidden_states, out.last_hidden_states = stacked
        return
    if aux_too and out.hidden_states is not None:
        out.hidden_states = async_d2h(out.hidden_states)
    if on_device:
        # A float32/float16 model: rounded to bfloat16 on the device (a kernel launch on
        # the scheduler thread, no work), so the copy moves half the bytes of float32.
        out.last_hidden_states = async_d2h(as_bf16(out.last_hidden_states))
    else:
        # On the host already (a CPU server): a float model's rows are rounded by the
        # writer threads (hsx_async.server.rows), not here.
        out.last_hidden_states = async_d2h(out.last_hidden_states)


def _stacks(state: HookState | None, dtype: Any) -> bool:
    """Whether a pass of this dtype takes the device stack (the operator's setting, else
    the measured default for the dtype)."""
    return state is not None and state.config.device_stack_for(str(dtype))


def as_bf16(tensor: Any) -> Any:
    """``tensor`` as bfloat16 where it lies (the same round-to-nearest-even as on the
    host); a bfloat16 tensor is returned as it is."""
    return tensor if tensor.dtype == torch.bfloat16 else tensor.to(torch.bfloat16)


def _copy_encoded(result: Any, state: HookState | None, async_d2h: Callable[[Any], Any]) -> bool:
    """An FP8 pass (every request of the last forward is marked for one FP8 storage): its
    rows quantized on the device and only the sections' bytes queued to the host, left on
    ``result`` for :func:`load_hidden`. SGLang's own copy of the aux rows is then not
    needed (no response of the pass carries hidden states): ``hidden_states`` is dropped.
    False: the bfloat16 path."""
    storage = state.pass_storage() if state is not None and state.writer else None
    if state is None or storage is None:
        return False
    out = result.logits_output
    encoded = encode_to_host(out.hidden_states, out.last_hidden_states, storage, async_d2h)
    if encoded is None:
        return False
    setattr(result, _ENCODED_ATTR, (storage, encoded))
    out.hidden_states = None
    state.encoded_passes += 1
    if storage not in state.encoded_storages:
        state.encoded_storages.add(storage)
        logger.info(
            "hsx hook: quantizing passes to %s on the %s device (the first: %d rows)",
            storage.describe(),
            out.last_hidden_states.device.type,
            int(out.last_hidden_states.shape[0]),
        )
    return True


def _on_accelerator(tensor: Any) -> bool:
    return bool(tensor.device.type != "cpu")


def stack_to_host(aux: Any, final: Any, async_d2h: Callable[[Any], Any]) -> tuple[Any, Any] | None:
    """The device stack (issue 16; on a GPU, the default for every dtype measured, issue 40:
    :data:`~hsx_async.server.hook_core.DEVICE_STACK_BY_DTYPE`): lay the pass out as
    ``[T, K+1, H]`` on the device, then make ONE copy of it to pinned host memory with
    SGLang's own ``async_d2h`` (its stream, so its ``copy_done`` event covers it). Returns
    host views ``(aux [T, K*H], final [T, H])`` of that buffer to put back on the logits output:
    SGLang's own aux copy then finds a host tensor and copies nothing, and every part is one
    contiguous slice of the buffer (:func:`~hsx_async.server.hook_core.stacked_rows`),
    written with no host copy.

    The stack is bfloat16 whatever the model's dtype: a float32 model's rows are rounded
    on the device, in the same copy (the rounding of the host path), and half the bytes
    cross. SGLang's own aux copy is then bfloat16 too: an ordinary request of the pass that
    asks for hidden states gets them in bfloat16.

    Costs ``T*(K+1)*H*2`` bytes of transient device memory. None (the plain path) when the
    shapes or dtypes do not allow it. Pure torch: the tests run it on CPU tensors.
    """
    if aux is None or final.ndim != 2 or aux.dtype != final.dtype or aux.device != final.device:
        return None
    t, h = int(final.shape[0]), int(final.shape[1])
    if t == 0 or aux.shape[0] != t or aux.numel() % (t * h):
        return None
    k = aux.numel() // (t * h)
    stacked = torch.empty((t, k + 1, h), dtype=torch.bfloat16, device=final.device)
    stacked[:, :k, :].copy_(aux.reshape(t, k, h))
    stacked[:, k, :].copy_(final)
    host = async_d2h(stacked)
    return host.as_strided((t, k * h), ((k + 1) * h, 1)), host[:, k, :]


def encode_to_host(
    aux: Any, final: Any, storage: Storage, async_d2h: Callable[[Any], Any]
) -> list[Any] | None:
    """An FP8 pass: lay the rows out as ``[T, L, H]`` bfloat16 on their device (the same
    rounding as the bfloat16 path's host conversion), quantize them there
    (:func:`hsx_async.quantize.encode_rows`), and queue one copy per section, as ``uint8
    [T, row bytes]``, to the host with SGLang's own ``async_d2h``. The host buffer,
    /dev/shm and the disk then carry the section bytes only. None (the bfloat16 path) when
    the shapes do not allow it. Pure torch: the tests run it on CPU tensors."""
    if aux is None or final.ndim != 2 or aux.device != final.device:
        return None
    t, h = int(final.shape[0]), int(final.shape[1])
    if t == 0 or aux.shape[0] != t or aux.numel() % (t * h):
        return None
    k = aux.numel() // (t * h)
    if k + 1 <= storage.quantized[-1]:
        return None
    rows = torch.empty((t, k + 1, h), dtype=torch.bfloat16, device=final.device)
    rows[:, :k, :].copy_(aux.reshape(t, k, h))
    rows[:, k, :].copy_(final)
    return [async_d2h(s.view(torch.uint8).reshape(t, -1)) for s in encode_rows(rows, storage)]


def _wrap_forward(original: Wrapper, state: HookState | None, full: object = None) -> Wrapper:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if state is not None:
            if state.stack is None:
                was_on = state.path == "server" or enable_model_capture(self.model)
                set_capture_layers(state, self.model)
                if not was_on:  # its CUDA graphs were recorded capturing nothing
                    state.graph_layers = ()
                warm_host_memory(state, self.model)
            batch = args[0] if args else kwargs.get("forward_batch")
            rids = getattr(batch, "rids", None)
            state.pass_rids = tuple(rids) if isinstance(rids, list | tuple) else None
            if state.path == "hook":
                mark_full_capture(batch, state.marked, full)
        return original(self, *args, **kwargs)

    return forward


def _wrap_prefill(original: Wrapper, state: HookState | None) -> Wrapper:
    def process_batch_result_prefill(self: Any, batch: Any, result: Any, *a: Any, **k: Any) -> Any:
        # Before SGLang consumes the result: it finishes requests and counts chunks down.
        if state is not None and state.writer:
            dump_prefill(state, batch, result)
        return original(self, batch, result, *a, **k)

    return process_batch_result_prefill


def find_capture_stack(model: Any) -> Any:
    """The decoder stack whose ``layers_to_capture`` drives aux capture."""
    for module in model.modules():
        if isinstance(getattr(module, "layers_to_capture", None), list) and hasattr(
            module, "layers"
        ):
            return module
    raise ConfigError(
        ENV_AUX_LAYERS,
        f"{type(model).__name__} has no decoder stack with a layers_to_capture list: the "
        "hsx hook needs a model with EAGLE-3 aux capture",
    )


def apply_capture_layers(stack: Any, layers: Sequence[int]) -> tuple[int, ...]:
    """Capture exactly ``layers`` (entering layer k, for each k); returns the layers the
    stack captured before, which are the ones SGLang's CUDA graphs were recorded with."""
    before = tuple(sorted(stack.layers_to_capture))
    check_aux_layers(layers, key=ENV_AUX_LAYERS, num_layers=len(stack.layers))
    stack.layers_to_capture = list(layers)
    # Some families (Qwen MoE, LFM2) capture by a per-layer flag instead of the list.
    for index, layer in enumerate(stack.layers):
        if index in layers or hasattr(layer, _LAYER_FLAG):
            setattr(layer, _LAYER_FLAG, index in layers)
    return before


def set_capture_layers(state: HookState, model: Any) -> None:
    stack = find_capture_stack(model)
    state.graph_layers = apply_capture_layers(stack, state.config.aux_layers)
    state.stack = stack
    logger.info(
        "hsx hook: %s captures layers %s (was %s)",
        type(stack).__name__,
        list(state.config.aux_layers),
        list(state.graph_layers),
    )


def model_pass_shape(config: HookConfig, stack: Any) -> PassShape | None:
    """The largest pass the hook will copy: ``HSX_PASS_ROWS`` rows, the width and dtype of
    the decoder stack's final norm (built in the served dtype; the module every family has,
    which --forward-hooks names), the path the config takes for that dtype. None where the
    stack has no such norm."""
    weight = getattr(getattr(stack, "norm", None), "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1 or not weight.is_floating_point():
        return None
    dtype = weight.dtype if weight.dtype in (torch.float32, torch.float16) else torch.bfloat16
    return PassShape(
        rows=config.pass_rows,
        hidden_size=int(weight.shape[0]),
        aux_layers=len(config.aux_layers),
        model_bytes=dtype.itemsize,
        device_stack=config.device_stack_for(str(dtype)),
    )


def warm_host_memory(state: HookState, model: Any) -> WarmResult | None:
    """Before the first pass: make ready the page-locked blocks the passes' copies will
    take (:mod:`hsx_async.server.pinned`) and say what it cost in the log. Every rank
    copies its passes (SGLang's aux copy, the hook's final or stacked copy); only a
    writing rank's passes wait for the writers, so the others hold the passes in flight.
    A no-op, said in the log, with ``HSX_PASS_ROWS=0``, where torch has no page-locked
    memory (a CPU-only build) or where the model shows no hidden size."""
    config = state.config
    stack = state.stack if state.stack is not None else find_capture_stack(model)
    shape = model_pass_shape(config, stack)
    allocate = state.allocate_pinned
    if config.pass_rows == 0 or allocate is None or shape is None:
        why = (
            "HSX_PASS_ROWS=0"
            if config.pass_rows == 0
            else "torch has no page-locked memory here (no CUDA)"
            if allocate is None
            else f"{type(stack).__name__} has no final norm to read the hidden size from"
        )
        logger.info("hsx hook: no page-locked host memory made ready (%s)", why)
        return None
    plan = plan_warmup(shape, config.write_queue_bytes, background=state.background is not None)
    state.warmed = warm(plan, allocate)
    logger.info("hsx hook: %s", describe(shape, plan, state.warmed, config.write_queue_bytes))
    return state.warmed


def req_views(batch: Any, result: Any, layers: int = 0) -> list[ReqView]:
    """Each request of a prefill pass; raises ValueError if the pass's layout is odd.
    ``layers`` (L) checks the storage a request asks for; 0: every dump is bfloat16."""
    lens = getattr(result, "extend_input_len_per_req", None)
    if lens is None:
        lens = batch.extend_lens
    starts = batch.prefix_lens
    if starts is None or lens is None:
        # 0.5.14: the batch copy the overlap scheduler hands the result processor keeps
        # neither; the hook's own path noted the pass's layout at its forward.
        layout = getattr(getattr(result, "logits_output", None), PASS_LAYOUT_ATTR, None)
        if layout is None:
            if not any(marked_ns(req.sampling_params.custom_params) for req in batch.reqs):
                return []  # nothing to dump from this pass
            raise ValueError("the pass's prefix and extend lengths are unknown")
        starts, lens = layout
    return [
        _req_view(req, start, rows, layers)
        for req, start, rows in zip(batch.reqs, starts, lens, strict=True)
    ]


def _req_view(req: Any, start: int, rows: int, layers: int) -> ReqView:
    params = req.sampling_params
    storage, note = request_storage(params.custom_params, layers) if layers else (BF16_STORAGE, "")
    return ReqView(
        rid=req.rid,
        ns=marked_ns(params.custom_params),
        num_tokens=len(req.origin_input_ids),
        max_new_tokens=params.max_new_tokens,
        start=int(start),
        rows=int(rows),
        last_chunk=req.inflight_middle_chunks <= 0,
        retracted=bool(req.is_retracted),
        aborted=bool(
            req.finished()
            or req.to_finish is not None
            # (0.5.22 on; before, no such abort)
            or getattr(req, "discard_output_reason", None) is not None
        ),
        storage=storage,
        storage_note=note,
    )


def dump_prefill(state: HookState, batch: Any, result: Any) -> None:
    try:
        views = req_views(batch, result, state.layers)
    except ValueError:
        logger.exception("hsx: cannot map a prefill pass to its requests; no dumps from it")
        return
    report = state.dumper.dump_batch(views, lambda: load_hidden(state, result))
    for view in views:
        if isinstance(view.rid, str) and (view.last_chunk or view.aborted):
            state.storages.pop(view.rid, None)
            state.marked.pop(view.rid, None)  # (other ranks: bounded, oldest first)
    for note in report.notes:
        logger.warning("hsx: rid %s %s", note.rid, note.reason)
    for reject in report.rejects:
        logger.warning("hsx: no dump for rid %s: %s", reject.rid, reject.reason)
    for rid in report.committed:
        logger.debug("hsx: committed %s", rid)


def load_hidden(state: HookState, result: Any) -> PassRows:
    """The pass's hidden rows, refused (DumpError) unless they are the configured layers."""
    # SGLang's host copies replace the tensors on the result; wait for them first.
    if getattr(result, "copy_done", None) is not None:
        result.copy_done.synchronize()
    encoded = getattr(result, _ENCODED_ATTR, None)
    if encoded is not None:
        return _encoded_pass(state, result, *encoded)
    out = getattr(result, "logits_output", None)
    final = getattr(out, FINAL_STATE_ATTR, None) if out is not None else None
    if out is None or out.hidden_states is None or final is None:
        raise DumpError(
            "the forward kept no aux and final hidden states: start SGLang with "
            "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3"
            if state.path == "server"
            else "the forward kept no aux and post-norm final hidden states (a model that "
            "hands the logits processor a pre-norm state, or a pass outside the hook's "
            "full capture)"
        )
    if getattr(out, "hidden_states_token_indices", None) is not None:
        raise DumpError("the forward captured only a subset of its rows")
    layers = _layers_in_effect(state)
    if result.can_run_cuda_graph and state.graph_layers != layers:
        raise DumpError(
            f"the pass ran through a prefill CUDA graph recorded with layers "
            f"{list(state.graph_layers or ())}: start SGLang with --disable-prefill-cuda-graph"
        )
    return BatchHidden(
        aux=host_rows(out.hidden_states),
        final=host_rows(final),
        aux_layers=layers,
    )


def _encoded_pass(state: HookState, result: Any, storage: Storage, hosts: list[Any]) -> EncodedPass:
    layers = _layers_in_effect(state)
    if result.can_run_cuda_graph and state.graph_layers != layers:
        raise DumpError(
            f"the pass ran through a prefill CUDA graph recorded with layers "
            f"{list(state.graph_layers or ())}: start SGLang with --disable-prefill-cuda-graph"
        )
    final = result.logits_output.last_hidden_states
    return EncodedPass(
        storage=storage,
        sections=tuple(host.numpy() for host in hosts),
        aux_layers=layers,
        hidden_size=int(final.shape[-1]),
    )


def _layers_in_effect(state: HookState) -> tuple[int, ...]:
    if state.stack is None:
        raise DumpError("no forward has gone through the hooked model runner")
    layers = tuple(state.stack.layers_to_capture)
    if layers != state.config.aux_layers:
        raise DumpError(
            f"the model captures layers {list(layers)}, not {ENV_AUX_LAYERS}="
            f"{list(state.config.aux_layers)}: something reset them after the hook"
        )
    return layers


def host_rows(tensor: Any) -> np.ndarray:
    """A torch tensor's rows as a host numpy array, without a copy where it already lies on
    the host with unit stride along its rows: bfloat16 as its bit patterns (2-byte
    integers), float32/float16 as they are (the writer threads round them to bfloat16:
    not the scheduler thread's work, issue 28); any other dtype as float32."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        t = t.to(torch.float32)
    if t.stride(-1) != 1:
        t = t.contiguous()
    # Row-strided views (a device-side stack's aux and final) stay views: no copy.
    rows: np.ndarray = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return rows
