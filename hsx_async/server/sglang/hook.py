"""The hsx hook inside SGLang 0.5.23: thin glue between SGLang's scheduler and
:mod:`hsx_async.server.hook_core`.

How it gets loaded: SGLang runs its schedulers (one per tensor-parallel rank) in spawned
processes, so a patch applied in the launcher would be lost. ``--forward-hooks`` names
:func:`hsx_hook_factory`; SGLang imports and calls it inside every rank's scheduler process
while it builds the model runner (``register_forward_hooks`` in
``model_executor/hook_manager.py``, called after CUDA-graph capture). The factory checks the
server's settings, then patches four methods in that process:

- ``Req.__init__``: a marked request (valid ``custom_params.hsx_ns`` and rid,
  ``max_new_tokens=0``) asks for full hidden-state capture, so its batches copy the hidden
  rows to the host right behind the forward. Its ``return_hidden_states`` stays False, so
  nothing goes into the JSON response.
- ``GenerationBatchResult.copy_to_cpu``: the final (post-norm) hidden state, which SGLang
  keeps next to the aux layers but does not copy, is copied along with them.
- ``ModelRunner.forward``: before the first forward, the decoder stack's
  ``layers_to_capture`` is set to ``HSX_AUX_LAYERS`` (layer k = the residual stream entering
  layer k = Hugging Face ``hidden_states[k]``), whatever numbering the model's
  ``set_eagle3_layers_to_capture`` uses.
- ``SchedulerBatchResultProcessor.process_batch_result_prefill``: before SGLang consumes a
  prefill result, attention-TP rank 0 hands each request's rows to
  :class:`~hsx_async.server.hook_core.PrefillDumper`, which writes one part per pass and
  commits ``meta.json`` after the last chunk.

SGLang is imported only inside functions: this module imports without it, and
:data:`SGLANG_TARGETS` lists everything the glue patches or reads, for the drift test.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import numpy as np

from hsx_async.errors import ConfigError, DumpError
from hsx_async.server.hook_core import (
    ENV_AUX_LAYERS,
    BatchHidden,
    HookConfig,
    PrefillDumper,
    ReqView,
    ServerSettings,
    check_server_settings,
    request_namespace,
    wants_dump,
)

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
# Names the one other SGLang version the operator accepts (the hook refuses others).
ENV_ALLOW_SGLANG_VERSION = "HSX_ALLOW_SGLANG_VERSION"
HOOK_FACTORY = "hsx_async.server.sglang_hook:hsx_hook_factory"
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


# --------------------------------------------------------------------------------------
# What the glue depends on in SGLang's source (the drift test reads this list)
# --------------------------------------------------------------------------------------

TargetKind = Literal["method", "attr", "function", "literal"]
_Def = TypeVar("_Def", ast.ClassDef, ast.FunctionDef)


@dataclass(frozen=True, slots=True)
class Target:
    """A name in SGLang's source the glue relies on; ``path`` is relative to the package."""

    path: str
    owner: str | None
    name: str
    kind: TargetKind
    why: str
    params: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if self.kind == "literal":
            return f"the string {self.name!r}"
        return f"{self.owner}.{self.name}" if self.owner else self.name


_BRP = "srt/managers/scheduler_components/batch_result_processor.py"
_SB = "srt/managers/schedule_batch.py"
_MU = "srt/managers/utils.py"
_MR = "srt/model_executor/model_runner.py"
_HM = "srt/model_executor/hook_manager.py"
_RC = "srt/runtime_context.py"
_LP = "srt/layers/logits_processor.py"
_FIELDS = "srt/arg_groups/fields/"


def _attrs(path: str, owner: str, names: str, why: str) -> tuple[Target, ...]:
    return tuple(Target(path, owner, n, "attr", why) for n in names.split())


def _literals(path: str, names: str, why: str) -> tuple[Target, ...]:
    return tuple(Target(path, None, n, "literal", why) for n in names.split())


# fmt: off
SGLANG_TARGETS: tuple[Target, ...] = (
    # Patched methods.
    Target(_BRP, "SchedulerBatchResultProcessor", "process_batch_result_prefill", "method",
           "wraps it to dump each prefill pass", ("self", "batch", "result")),
    Target(_SB, "Req", "__init__", "method", "wraps it to mark hsx requests for full capture"),
    Target(_MU, "GenerationBatchResult", "copy_to_cpu", "method",
           "wraps it to copy the final hidden state to the host",
           ("self", "return_logprob", "return_hidden_states")),
    Target(_MR, "ModelRunner", "forward", "method",
           "wraps it to set the captured layers before the first forward"),
    Target(_MR, "ModelRunner", "model", "attr", "finds the decoder stack through it"),
    # How --forward-hooks loads the factory in each rank's process.
    Target(_HM, None, "register_forward_hooks", "function",
           "is loaded by it (--forward-hooks)", ("model", "hook_specs")),
    Target(_HM, None, "resolve_callable", "function", "is named as 'module:factory'"),
    *_literals(_HM, "name target_modules hook_factory config",
               "is loaded from a --forward-hooks spec with these keys"),
    Target("srt/model_executor/model_runner_components/cuda_graph_setup.py", None,
           "finalize_cuda_graph_capture", "function",
           "relies on it to call register_forward_hooks in every rank's process"),
    # Per-request state read at each prefill result.
    *_attrs(_SB, "Req",
            "rid sampling_params origin_input_ids is_retracted inflight_middle_chunks "
            "to_finish discard_output_reason return_hidden_states_mode finished",
            "reads or sets it for every request of a prefill pass"),
    *_attrs("srt/sampling/sampling_params.py", "SamplingParams", "custom_params max_new_tokens",
            "reads hsx_ns and the prefill-only setting from it"),
    *_attrs(_SB, "ScheduleBatch", "reqs prefix_lens extend_lens",
            "maps a pass's hidden rows to its requests with it"),
    *_attrs(_MU, "GenerationBatchResult",
            "logits_output extend_input_len_per_req copy_done can_run_cuda_graph",
            "reads a prefill result through it"),
    *_attrs(_LP, "LogitsProcessorOutput",
            "hidden_states last_hidden_states hidden_states_token_indices",
            "takes the aux layers and the final hidden state from it"),
    Target("srt/model_executor/forward_batch_info.py", "CaptureHiddenMode", "FULL", "attr",
           "asks for full capture with it"),
    Target("srt/utils/common.py", None, "async_d2h", "function",
           "copies the final hidden state to the host with it"),
    # Model side (Llama as the reference family): capture before layer i if i is listed.
    *_attrs("srt/models/llama.py", "LlamaModel", "layers_to_capture layers",
            "sets the captured layers on the decoder stack through it"),
    # Server settings checked at start-up.
    *(Target(_RC, None, n, "function", "reads the server settings through it")
      for n in ("get_parallel", "get_memory", "get_exec", "get_disagg", "get_serving")),
    *_literals(_RC, "attn_tp_rank", "lets only attention-TP rank 0 write"),
    *_literals(_FIELDS + "exec_.py", "exec.features exec.overlap exec.moe",
               "reads settings from these namespaces"),
    *_attrs(_FIELDS + "memory.py", "Memory", "disable_radix_cache", "refuses the radix cache"),
    *_attrs(_FIELDS + "parallel.py", "Parallel", "attn_dp_size pp_size",
            "refuses DP attention and pipeline parallelism"),
    *_attrs(_FIELDS + "exec_.py", "ExecOverlap", "enable_two_batch_overlap",
            "refuses two-batch overlap"),
    *_attrs(_FIELDS + "exec_.py", "ExecMoe", "moe_a2a_backend", "refuses DeepEP"),
    *_attrs(_FIELDS + "exec_.py", "ExecFeatures",
            "aux_hidden_state_capture return_aux_hidden_state_layer_ids",
            "requires EAGLE-3 aux capture"),
    *_attrs(_FIELDS + "disagg.py", "Disagg", "disaggregation_mode",
            "refuses PD disaggregation"),
    *_attrs(_FIELDS + "serving.py", "Serving", "served_model_name",
            "names the model in meta.json by default"),
)
# fmt: on


def sglang_source_root() -> Path | None:
    """The installed ``sglang`` package directory, found without importing sglang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_sglang_version(installed: str | None, env: Mapping[str, str]) -> str:
    """``installed``, refused unless it is :data:`SGLANG_VERSION` or the operator named
    exactly it in ``HSX_ALLOW_SGLANG_VERSION``. Another release can keep every name the glue
    reads and change what a row means (layer numbering, batch order, padding); its dumps
    would pass every client check and train a drafter on the wrong rows."""
    version = installed or "unknown"
    if version == SGLANG_VERSION:
        return version
    if env.get(ENV_ALLOW_SGLANG_VERSION) == version:
        logger.warning(
            "hsx hook is checked against sglang %s, running %s (allowed by %s)",
            SGLANG_VERSION,
            version,
            ENV_ALLOW_SGLANG_VERSION,
        )
        return version
    raise ConfigError(
        "",
        f"the hsx hook is checked against sglang {SGLANG_VERSION}, but sglang {version} is "
        f"installed: install sglang=={SGLANG_VERSION}, or set {ENV_ALLOW_SGLANG_VERSION}="
        f"{version} to run it anyway (after checking its dumps, e.g. with the real-SGLang "
        "test tier)",
    )


def check_targets(root: Path, targets: Sequence[Target] = SGLANG_TARGETS) -> list[str]:
    """One line per target missing from the SGLang source under ``root``, naming it."""
    trees: dict[str, ast.Module | str] = {}
    problems = []
    for target in targets:
        if target.path not in trees:
            trees[target.path] = _parse(root / target.path)
        tree = trees[target.path]
        problem = tree if isinstance(tree, str) else _check_target(tree, target)
        if problem is not None:
            problems.append(f"{target.label} ({target.path}): {problem}; the hsx hook {target.why}")
    return problems


def _parse(path: Path) -> ast.Module | str:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except FileNotFoundError:
        return "the file is gone"
    except SyntaxError as exc:
        return f"the file does not parse ({exc})"


def _check_target(tree: ast.Module, target: Target) -> str | None:
    if target.kind == "literal":
        found = any(
            isinstance(node, ast.Constant) and node.value == target.name for node in ast.walk(tree)
        )
        return None if found else "the string is gone"
    scope: list[ast.stmt] = tree.body
    if target.owner is not None:
        cls = _find_def(tree.body, target.owner, ast.ClassDef)
        if cls is None:
            return f"class {target.owner} is gone or renamed"
        scope = cls.body
        if target.kind == "attr":
            return None if _class_has_attr(cls, target.name) else "gone or renamed"
    fn = _find_def(scope, target.name, ast.FunctionDef)
    if fn is None:
        return "gone or renamed"
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if tuple(names[: len(target.params)]) != target.params:
        return f"its parameters are now ({', '.join(names)}), expected {target.params}"
    return None


def _find_def(body: list[ast.stmt], name: str, kind: type[_Def]) -> _Def | None:
    for node in body:
        if isinstance(node, kind) and getattr(node, "name", None) == name:
            return node
    return None


def _class_has_attr(cls: ast.ClassDef, name: str) -> bool:
    """Declared in the class body (field, constant, method, property) or set as
    ``self.<name>`` in one of its methods."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        if isinstance(node, ast.AnnAssign | ast.Assign) and name in _assigned_names(node):
            return True
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == name
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        for node in ast.walk(cls)
    )


def _assigned_names(node: ast.AnnAssign | ast.Assign) -> set[str]:
    targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def launch_flags(script: str) -> list[str]:
    """The ``--long-options`` a launch script passes, as SGLang field names."""
    return sorted(
        {m.replace("-", "_") for m in re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", script)}
    )


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


def _load_sglang_api() -> SglangApi:
    # SGLang is imported here, never at module level: this module must import (and the
    # drift test must run) where SGLang's dependencies are not installed.
    import sglang.srt.managers.scheduler_components.batch_result_processor as brp  # noqa: PLC0415
    from sglang.srt.managers.schedule_batch import Req  # noqa: PLC0415
    from sglang.srt.managers.utils import GenerationBatchResult  # noqa: PLC0415
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode  # noqa: PLC0415
    from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: PLC0415
    from sglang.srt.utils.common import async_d2h  # noqa: PLC0415

    return SglangApi(
        req_cls=Req,
        processor_cls=brp.SchedulerBatchResultProcessor,
        result_cls=GenerationBatchResult,
        runner_cls=ModelRunner,
        full_capture=CaptureHiddenMode.FULL,
        async_d2h=async_d2h,
    )


@dataclass(frozen=True, slots=True)
class ServerInfo:
    settings: ServerSettings
    attn_tp_rank: int
    served_model_name: str | None


def _read_server_info() -> ServerInfo:
    import sglang.srt.runtime_context as rc  # noqa: PLC0415 (see _load_sglang_api)

    parallel, exec_ = rc.get_parallel(), rc.get_exec()
    layer_ids = exec_.features.return_aux_hidden_state_layer_ids
    mode = rc.get_disagg().disaggregation_mode
    settings = ServerSettings(
        radix_cache=not rc.get_memory().disable_radix_cache,
        attn_dp_size=int(parallel.attn_dp_size),
        pp_size=int(parallel.pp_size),
        two_batch_overlap=bool(exec_.overlap.enable_two_batch_overlap),
        moe_a2a_backend=str(exec_.moe.moe_a2a_backend),
        aux_capture=exec_.features.aux_hidden_state_capture,
        aux_layer_ids_flag=None if layer_ids is None else tuple(layer_ids),
        disaggregation_mode=str(getattr(mode, "value", mode)),
    )
    served = rc.get_serving().served_model_name
    return ServerInfo(settings, int(parallel.attn_tp_rank), str(served) if served else None)


@dataclass(slots=True)
class HookState:
    """The hook's state in one scheduler process."""

    config: HookConfig
    dumper: PrefillDumper
    writer: bool
    stack: Any = None
    graph_layers: tuple[int, ...] | None = None


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
        info = _read_server_info()
        check_server_settings(info.settings, hook_config)
        model = hook_config.model or info.served_model_name or ""
        state = HookState(
            config=hook_config,
            dumper=PrefillDumper(hook_config, model=model),
            writer=info.attn_tp_rank == 0,
        )
        install(state, _load_sglang_api())
        logger.info(
            "hsx hook installed: aux layers %s, dump root %s, %s rank",
            list(hook_config.aux_layers),
            hook_config.dump_root,
            "writing" if state.writer else "non-writing",
        )
    return _forward_hook_noop


def _forward_hook_noop(module: Any, args: Any, output: Any) -> None:
    """--forward-hooks needs a hook; the hsx hook works through the factory's patches."""


def install(state: HookState, api: SglangApi) -> None:
    """Patch ``api``'s classes for ``state``; a method already patched is left as it is."""
    plan = _patch_plan(state, api)
    missing = [f"{cls.__name__}.{name}" for cls, name, _ in plan if name not in cls.__dict__]
    if missing:
        raise ConfigError(
            "", f"{', '.join(missing)} missing: the hsx hook needs sglang {SGLANG_VERSION}"
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
    return [
        (api.req_cls, "__init__", lambda orig: _wrap_req_init(orig, api.full_capture)),
        (api.result_cls, "copy_to_cpu", lambda orig: _wrap_copy_to_cpu(orig, api.async_d2h)),
        (api.runner_cls, "forward", lambda orig: _wrap_forward(orig, state)),
        (
            api.processor_cls,
            "process_batch_result_prefill",
            lambda orig: _wrap_prefill(orig, state),
        ),
    ]


def _wrap_req_init(original: Wrapper, full_capture: object) -> Wrapper:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        params = self.sampling_params
        if wants_dump(self.rid, params.custom_params, params.max_new_tokens):
            # Full capture for this request's batches, without return_hidden_states: the
            # rows are copied to the host, but never serialised into the response.
            self.return_hidden_states_mode = full_capture

    return __init__


def _wrap_copy_to_cpu(original: Wrapper, async_d2h: Callable[[Any], Any]) -> Wrapper:
    def copy_to_cpu(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = self.logits_output
        wanted = kwargs.get("return_hidden_states", args[1] if len(args) > 1 else True)
        if wanted and out is not None and out.last_hidden_states is not None:
            # Queued before SGLang's own copies, so its copy_done event covers this one
            # too, and right behind the forward, before a later pass reuses the buffer.
            out.last_hidden_states = async_d2h(out.last_hidden_states)
        return original(self, *args, **kwargs)

    return copy_to_cpu


def _wrap_forward(original: Wrapper, state: HookState | None) -> Wrapper:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if state is not None and state.stack is None:
            set_capture_layers(state, self.model)
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
    count = len(stack.layers)
    missing = [k for k in layers if k >= count]
    if missing:
        raise ConfigError(
            ENV_AUX_LAYERS,
            f"layers {missing} do not exist: the model has {count} decoder layers, so k < "
            f"{count} (the final hidden state is always added after the aux layers)",
        )
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


def req_views(batch: Any, result: Any) -> list[ReqView]:
    """Each request of a prefill pass; raises ValueError if the pass's layout is odd."""
    lens = getattr(result, "extend_input_len_per_req", None)
    if lens is None:
        lens = batch.extend_lens
    return [
        _req_view(req, start, rows)
        for req, start, rows in zip(batch.reqs, batch.prefix_lens, lens, strict=True)
    ]


def _req_view(req: Any, start: int, rows: int) -> ReqView:
    params = req.sampling_params
    return ReqView(
        rid=req.rid,
        ns=request_namespace(params.custom_params),
        num_tokens=len(req.origin_input_ids),
        max_new_tokens=params.max_new_tokens,
        start=int(start),
        rows=int(rows),
        last_chunk=req.inflight_middle_chunks <= 0,
        retracted=bool(req.is_retracted),
        aborted=bool(
            req.finished() or req.to_finish is not None or req.discard_output_reason is not None
        ),
    )


def dump_prefill(state: HookState, batch: Any, result: Any) -> None:
    try:
        views = req_views(batch, result)
    except ValueError:
        logger.exception("hsx: cannot map a prefill pass to its requests; no dumps from it")
        return
    report = state.dumper.dump_batch(views, lambda: load_hidden(state, result))
    for reject in report.rejects:
        logger.warning("hsx: no dump for rid %s: %s", reject.rid, reject.reason)
    for rid in report.committed:
        logger.debug("hsx: committed %s", rid)


def load_hidden(state: HookState, result: Any) -> BatchHidden:
    """The pass's hidden rows, refused (DumpError) unless they are the configured layers."""
    # SGLang's host copies replace the tensors on the result; wait for them first.
    if getattr(result, "copy_done", None) is not None:
        result.copy_done.synchronize()
    out = getattr(result, "logits_output", None)
    if out is None or out.hidden_states is None or out.last_hidden_states is None:
        raise DumpError(
            "the forward kept no aux and final hidden states: start SGLang with "
            "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3"
        )
    if out.hidden_states_token_indices is not None:
        raise DumpError("the forward captured only a subset of its rows")
    layers = _layers_in_effect(state)
    if result.can_run_cuda_graph and state.graph_layers != layers:
        raise DumpError(
            f"the pass ran through a prefill CUDA graph recorded with layers "
            f"{list(state.graph_layers or ())}: start SGLang with --disable-prefill-cuda-graph"
        )
    return BatchHidden(
        aux=tensor_bits(out.hidden_states),
        final=tensor_bits(out.last_hidden_states),
        aux_layers=layers,
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


def tensor_bits(tensor: Any) -> np.ndarray:
    """A torch tensor as a host numpy array of its bfloat16 bit patterns (no copy when it
    already is a contiguous host bfloat16 tensor)."""
    import torch  # noqa: PLC0415 (torch is SGLang's; `hsx --help` must not load it)

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    bits: np.ndarray = t.contiguous().view(torch.int16).numpy()
    return bits
