"""What the hsx hook's glue relies on in SGLang's source (:data:`SGLANG_TARGETS`), for the
drift checker (:mod:`hsx_async.server.drift`): ``tests/server/sglang/test_sglang_drift.py``
runs it on the installed release, ``.ci/engine-drift`` on every release of the range
(:mod:`hsx_async.server.engine_versions`). Dev-only: the hook SGLang imports
(:mod:`hsx_async.server.sglang.hook`) never imports this module, so none of it loads inside
a scheduler process.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

from hsx_async.server.drift import SourceRoot, Target, check_targets
from hsx_async.server.sglang.releases import capture_flags, capture_path

__all__ = [
    "COMMON_TARGETS",
    "HOOK_CAPTURE_TARGETS",
    "SERVER_CAPTURE_TARGETS",
    "SGLANG_TARGETS",
    "Target",
    "check_targets",
    "launch_flags",
    "release_problems",
    "release_targets",
    "release_version",
    "server_arguments",
    "sglang_source_root",
]

# The launch script whose flags every release of the range must know (a checkout's file).
LAUNCH_SCRIPT = Path(__file__).resolve().parents[3] / "deploy" / "sglang" / "launch.sh"


def _attrs(path: str, owner: str, names: str, why: str) -> tuple[Target, ...]:
    return tuple(Target(path, owner, n, "attr", why) for n in names.split())


def _literals(path: str, names: str, why: str) -> tuple[Target, ...]:
    return tuple(Target(path, None, n, "literal", why) for n in names.split())


_BRP = "srt/managers/scheduler_components/batch_result_processor.py"
_SB = "srt/managers/schedule_batch.py"
_MU = "srt/managers/utils.py"
_MR = "srt/model_executor/model_runner.py"
_HM = "srt/model_executor/hook_manager.py"
_RC = "srt/runtime_context.py"
_LP = "srt/layers/logits_processor.py"
_FIELDS = "srt/arg_groups/fields/"
_FB = "srt/model_executor/forward_batch_info.py"
_SA = "srt/server_args.py"
_CGS = "srt/model_executor/model_runner_components/cuda_graph_setup.py"
_REGISTER = "register_forward_hooks"


# fmt: off
# What every release of the range has (both capture paths rely on it).
COMMON_TARGETS: tuple[Target, ...] = (
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
    # Per-request state read at each prefill result.
    *_attrs(_SB, "Req",
            "rid sampling_params origin_input_ids is_retracted inflight_middle_chunks "
            "to_finish finished",
            "reads or sets it for every request of a prefill pass"),
    *_attrs("srt/sampling/sampling_params.py", "SamplingParams", "custom_params max_new_tokens",
            "reads hsx_ns and the prefill-only setting from it"),
    *_attrs(_SB, "ScheduleBatch", "reqs prefix_lens extend_lens",
            "maps a pass's hidden rows to its requests with it"),
    *_attrs(_MU, "GenerationBatchResult",
            "logits_output extend_input_len_per_req copy_done can_run_cuda_graph",
            "reads a prefill result through it"),
    *_attrs(_LP, "LogitsProcessorOutput", "hidden_states",
            "takes the aux layers from it"),
    Target(_FB, "CaptureHiddenMode", "FULL", "attr", "asks for full capture with it"),
    Target(_FB, "ForwardBatch", "rids", "attr",
           "finds the marked requests of a pass (and quantizes a pass on the device when all "
           "its requests ask for one FP8 storage)"),
    # Model side (Llama as the reference family): capture before layer i if i is listed.
    *_attrs("srt/models/llama.py", "LlamaModel", "layers_to_capture layers",
            "sets the captured layers on the decoder stack through it"),
    *_attrs("srt/models/llama.py", "LlamaModel", "norm",
            "reads the hidden size and the served dtype from the final norm's weight (the "
            "page-locked warm-up)"),
    # Server settings checked at start-up.
    Target(_RC, None, "get_parallel", "function", "reads the parallel layout through it"),
    *_literals(_RC, "attn_tp_rank attn_tp_size",
               "lets attention-TP rank 0 of each DP group write, refuses padded DP attention"),
)

# SGLang's own capture-only aux mode (releases.SERVER_CAPTURE_FROM on).
SERVER_CAPTURE_TARGETS: tuple[Target, ...] = (
    *_attrs(_SB, "Req", "return_hidden_states_mode discard_output_reason",
            "reads or sets it for every request of a prefill pass"),
    *_attrs(_LP, "LogitsProcessorOutput", "last_hidden_states hidden_states_token_indices",
            "takes the final hidden state from it (--enable-return-aux-hidden-states)"),
    Target("srt/utils/common.py", None, "async_d2h", "function",
           "copies the final hidden state to the host with it"),
    *_literals(_FIELDS + "exec_.py", "exec.features", "reads settings from these namespaces"),
    *_attrs(_FIELDS + "exec_.py", "ExecFeatures",
            "aux_hidden_state_capture return_aux_hidden_state_layer_ids",
            "requires EAGLE-3 aux capture"),
)

# The hook's own capture path (hsx_async.server.sglang.capture: releases before it).
HOOK_CAPTURE_TARGETS: tuple[Target, ...] = (
    Target(_LP, "LogitsProcessor", "forward", "method",
           "wraps it to keep its hidden_states argument (the post-norm final state)",
           ("self", "input_ids", "hidden_states", "lm_head", "logits_metadata",
            "aux_hidden_states", "hidden_states_before_norm")),
    Target(_LP, "LogitsProcessor", "forward", "calls",
           "relies on it storing the aux layers of every row in full capture mode",
           ("_get_hidden_states_to_store",)),
    Target(_FB, "ForwardBatch", "capture_hidden_mode", "attr",
           "puts a pass with a marked request in full capture mode through it"),
    Target("srt/models/llama.py", "LlamaForCausalLM", "set_eagle3_layers_to_capture", "method",
           "turns the model's aux capture on with it", ("self", "layer_ids")),
    Target("srt/models/llama.py", "LlamaForCausalLM", "capture_aux_hidden_states", "attr",
           "checks the model's aux capture is on through it"),
)

# Where the server settings are (0.5.20 on: runtime_context's groups; before: ServerArgs).
GROUPED_SETTINGS_TARGETS: tuple[Target, ...] = (
    *(Target(_RC, None, n, "function", "reads the server settings through it")
      for n in ("get_memory", "get_exec", "get_disagg", "get_serving")),
    *_literals(_FIELDS + "exec_.py", "exec.overlap exec.moe",
               "reads settings from these namespaces"),
    *_attrs(_FIELDS + "memory.py", "Memory", "disable_radix_cache", "refuses the radix cache"),
    *_attrs(_FIELDS + "parallel.py", "Parallel", "attn_dp_size attn_tp_size pp_size",
            "refuses padded DP attention and pipeline parallelism"),
    *_attrs(_FIELDS + "exec_.py", "ExecOverlap", "enable_two_batch_overlap",
            "refuses two-batch overlap"),
    *_attrs(_FIELDS + "exec_.py", "ExecMoe", "moe_a2a_backend", "refuses DeepEP"),
    *_attrs(_FIELDS + "disagg.py", "Disagg", "disaggregation_mode",
            "refuses PD disaggregation"),
    *_attrs(_FIELDS + "serving.py", "Serving", "served_model_name",
            "names the model in meta.json by default"),
)
GROUPED_SPEC_TARGETS: tuple[Target, ...] = (
    Target(_RC, None, "get_spec", "function", "refuses a speculative algorithm through it"),
    *_attrs(_FIELDS + "spec.py", "Spec", "speculative_algorithm",
            "refuses a speculative algorithm (it captures the aux layers itself)"),
)
FLAT_SETTINGS_TARGETS: tuple[Target, ...] = (
    Target(_SA, None, "get_global_server_args", "function",
           "reads the server settings through it"),
    *_attrs(_SA, "ServerArgs",
            "disable_radix_cache enable_two_batch_overlap moe_a2a_backend "
            "disaggregation_mode served_model_name speculative_algorithm",
            "refuses the settings that break dumps, names the model in meta.json"),
)
# fmt: on

# Every target of the release the package was built from (tests that rename each one).
SGLANG_TARGETS = COMMON_TARGETS + SERVER_CAPTURE_TARGETS + GROUPED_SETTINGS_TARGETS


def release_version(root: SourceRoot) -> str | None:
    """The version the source under ``root`` was built as (``sglang/_version.py``)."""
    try:
        text = (root / "_version.py").read_text(encoding="utf-8")
    except (FileNotFoundError, KeyError):
        return None
    match = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
    return match.group(1) if match else None


def release_targets(root: SourceRoot, version: str) -> tuple[Target, ...]:
    """The targets of the release under ``root``: the common ones, its capture path's
    (:func:`hsx_async.server.sglang.releases.capture_path`, as the hook picks it), its
    settings' place, and the function that loads --forward-hooks in each rank's process."""
    path = capture_path(version)
    grouped = _is_dir(root / "srt" / "arg_groups" / "fields")
    targets = list(COMMON_TARGETS)
    targets += SERVER_CAPTURE_TARGETS if path == "server" else HOOK_CAPTURE_TARGETS
    targets += GROUPED_SETTINGS_TARGETS if grouped else FLAT_SETTINGS_TARGETS
    if path == "hook" and grouped:
        targets += GROUPED_SPEC_TARGETS
    return tuple(targets)


def forward_hooks_call_problems(root: SourceRoot) -> list[str]:
    """The model runner must still call ``register_forward_hooks`` (in ``model_runner.py``
    before 0.5.16, in its ``cuda_graph_setup.py`` component after; the function moved)."""
    for rel in (_MR, _CGS):
        try:
            tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        except (FileNotFoundError, KeyError, SyntaxError):
            continue
        if any(
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == _REGISTER
            for node in ast.walk(tree)
        ):
            return []
    return [
        f"{_REGISTER} ({_MR}, {_CGS}): no call left; the hsx hook is loaded by it in every "
        "rank's process (--forward-hooks)"
    ]


def _is_dir(path: SourceRoot) -> bool:
    return path.is_dir()


def sglang_source_root() -> Path | None:
    """The installed ``sglang`` package directory, found without importing sglang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def launch_flags(script: str) -> list[str]:
    """The ``--long-options`` a launch script passes, as SGLang field names."""
    return sorted(
        {m.replace("-", "_") for m in re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", script)}
    )


def server_arguments(root: SourceRoot) -> set[str]:
    """Every server argument the SGLang source under ``root`` declares (its CLI flags, with
    '_' for '-'): the fields of its ``srt/arg_groups/fields`` classes (0.5.20 on) and of
    ``ServerArgs`` (``srt/server_args.py``, where they were before)."""
    fields: set[str] = set()
    folder = root / "srt" / "arg_groups" / "fields"
    files = [p for p in folder.iterdir() if p.name.endswith(".py")] if folder.is_dir() else []
    flat = root / "srt" / "server_args.py"
    for path in [*files, *([flat] if flat.is_file() else [])]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and (path is not flat or node.name == "ServerArgs"):
                fields.update(
                    item.target.id
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                )
    return fields


def release_problems(root: SourceRoot) -> list[str]:
    """What the glue and ``deploy/sglang/launch.sh`` rely on and the release under ``root``
    lacks (``.ci/engine-drift``), one line each: the targets of its capture path
    (:func:`release_targets`), and the launch flags the script passes on it."""
    version = release_version(root)
    if version is None:
        return ["sglang/_version.py: no __version__; the drift check picks a release's "
                "targets by its version"]  # fmt: skip
    problems = check_targets(root, release_targets(root, version))
    problems += forward_hooks_call_problems(root)
    if LAUNCH_SCRIPT.is_file():
        flags = launch_flags(LAUNCH_SCRIPT.read_text(encoding="utf-8"))
        flags += launch_flags(" ".join(capture_flags(capture_path(version))))
        unknown = sorted(set(flags) - server_arguments(root))
        problems += [
            f"--{f.replace('_', '-')}: no such server argument; deploy/sglang/launch.sh passes "
            f"it on sglang {version}"
            for f in unknown
        ]
    return problems
