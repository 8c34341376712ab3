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

__all__ = [
    "SGLANG_TARGETS",
    "Target",
    "check_targets",
    "launch_flags",
    "release_problems",
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
    Target("srt/model_executor/forward_batch_info.py", "ForwardBatch", "rids", "attr",
           "quantizes a pass on the device when all its requests ask for one FP8 storage"),
    Target("srt/utils/common.py", None, "async_d2h", "function",
           "copies the final hidden state to the host with it"),
    # Model side (Llama as the reference family): capture before layer i if i is listed.
    *_attrs("srt/models/llama.py", "LlamaModel", "layers_to_capture layers",
            "sets the captured layers on the decoder stack through it"),
    *_attrs("srt/models/llama.py", "LlamaModel", "norm",
            "reads the hidden size and the served dtype from the final norm's weight (the "
            "page-locked warm-up)"),
    # Server settings checked at start-up.
    *(Target(_RC, None, n, "function", "reads the server settings through it")
      for n in ("get_parallel", "get_memory", "get_exec", "get_disagg", "get_serving")),
    *_literals(_RC, "attn_tp_rank attn_tp_size",
               "lets attention-TP rank 0 of each DP group write, refuses padded DP attention"),
    *_literals(_FIELDS + "exec_.py", "exec.features exec.overlap exec.moe",
               "reads settings from these namespaces"),
    *_attrs(_FIELDS + "memory.py", "Memory", "disable_radix_cache", "refuses the radix cache"),
    *_attrs(_FIELDS + "parallel.py", "Parallel", "attn_dp_size attn_tp_size pp_size",
            "refuses padded DP attention and pipeline parallelism"),
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


def launch_flags(script: str) -> list[str]:
    """The ``--long-options`` a launch script passes, as SGLang field names."""
    return sorted(
        {m.replace("-", "_") for m in re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", script)}
    )


def server_arguments(root: SourceRoot) -> set[str]:
    """Every server argument the SGLang source under ``root`` declares (its CLI flags, with
    '_' for '-'): the fields of its ``srt/arg_groups/fields`` classes."""
    fields: set[str] = set()
    folder = root / "srt" / "arg_groups" / "fields"
    for path in folder.iterdir() if folder.is_dir() else ():
        if not path.name.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                fields.update(
                    item.target.id
                    for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                )
    return fields


def release_problems(root: SourceRoot) -> list[str]:
    """What the glue and ``deploy/sglang/launch.sh`` rely on and the release under ``root``
    lacks (``.ci/engine-drift``), one line each."""
    problems = check_targets(root, SGLANG_TARGETS)
    if LAUNCH_SCRIPT.is_file():
        flags = launch_flags(LAUNCH_SCRIPT.read_text(encoding="utf-8"))
        unknown = sorted(set(flags) - server_arguments(root))
        problems += [
            f"--{f.replace('_', '-')}: no such server argument; deploy/sglang/launch.sh passes it"
            for f in unknown
        ]
    return problems
