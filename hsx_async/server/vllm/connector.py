"""The hsx KV connector for vLLM (the releases :mod:`hsx_async.server.engine_versions` states;
any other is refused at start-up) (``--kv-transfer-config`` with
``"kv_connector": "HsxHiddenStatesConnector"`` and ``"kv_connector_module_path":
"hsx_async.server.vllm.connector"``), used with the ``extract_hidden_states`` speculative
method. Thin glue over :mod:`.core`: vLLM's ``ExampleHiddenStatesConnector`` does the
bookkeeping (block ids held until the rows are read back, TP rank 0 only); this subclass

- marks only requests whose ``kv_transfer_params`` carry a valid ``hsx_ns``/``hsx_rid``
  (others are served as usual and nothing is kept for them),
- refuses to start with prefix caching on or layer ids that do not end with the final
  state, and
- writes PROTOCOL §3 dumps (one part, then ``meta.json``) through the dumper every hook
  uses (:func:`.core.write_dump`), on its writer threads, instead of one safetensors file
  per request; on a CPU it reads the rows straight from the cache (vLLM's class assumes CUDA:
  pinned memory and CUDA events), on a GPU it copies them on a side stream into pinned
  memory first, as vLLM does;
- for a request asking for FP8 (``hsx_dtype``/``hsx_quantized``), quantizes the rows where
  they are read back (on the GPU, before the copy: the pinned buffer, /dev/shm and the
  disk carry the smaller sections).

Only vLLM imports this module (it imports vLLM and torch).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

from hsx_async.protocol import Storage
from hsx_async.quantize import encode_rows
from hsx_async.server.engine_versions import check_engine_version
from hsx_async.server.hook_core import dump_root_from_env
from hsx_async.server.vllm.core import (
    PARAM_NS,
    PARAM_RID,
    Target,
    check_prefix_caching,
    hook_config,
    layer_plan,
    marked_target,
    parse_target_path,
    write_dump,
)

log = init_logger("vllm.hsx")  # vLLM's handlers: the lines land in the server's log


def _bf16(rows: torch.Tensor) -> torch.Tensor:
    """The dump's dtype (PROTOCOL §3): a float32 or float16 model's rows are rounded once,
    on the device, before the copy (which then moves half the bytes of float32)."""
    return rows.to(torch.bfloat16).contiguous()


def _sections(rows: torch.Tensor, storage: Storage) -> list[torch.Tensor]:
    """The part's sections, as ``uint8 [T, row bytes]`` on the rows' device: the bfloat16
    rows, or their FP8 sections (quantized there) in file order."""
    t = int(rows.shape[0])
    return [s.view(torch.uint8).reshape(t, -1) for s in encode_rows(_bf16(rows), storage)]


class _Copied:
    """A finished device→host copy (the CPU path has nothing to wait for)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HsxHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        check_engine_version("vllm", vllm.__version__)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_prefix_caching(bool(vllm_config.cache_config.enable_prefix_caching))
        spec = vllm_config.speculative_config.draft_model_config.hf_config
        model = vllm_config.model_config
        self._plan = layer_plan(
            getattr(spec, "eagle_aux_hidden_state_layer_ids", None),
            model.get_total_num_hidden_layers(),
            model.get_hidden_size(),
        )
        self._config = hook_config(
            dump_root_from_env(os.environ),
            self._plan,
            model=str(model.served_model_name or model.model),
            server=f"vllm {vllm.__version__}",
        )
        self.use_lock = False  # the commit is meta.json, renamed last
        self._targets: dict[str, Target] = {}  # scheduler side: marked requests
        self._submitted: set[str] = set()  # worker side: requests whose rows are read back
        log.info(
            "hsx connector: dumping aux layers %s + pre-norm final state to %s",
            list(self._plan.aux_layers),
            self._config.dump_root,
        )

    def get_finished_count(self) -> int:
        """One ``finished_sending`` per marked request: only TP rank 0 reads rows back.
        vLLM 0.31 added this to its connector; before it (0.24-0.30) the default, the world
        size, left a marked request's blocks held for ever under TP > 1."""
        return 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM's, reporting only the requests whose rows this worker reads back. Before
        0.31, vLLM's connector reported every finished request as sent, ordinary ones
        included, whose blocks the scheduler had already freed: its first finished plain
        request stopped the engine (``assert req_id in self.requests``)."""
        sending, receiving = super().get_finished(finished_req_ids)
        if sending:
            sending = {req for req in sending if req in self._submitted}
            self._submitted -= sending
        return sending or None, receiving

    # -- scheduler side -----------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> ExampleHiddenStatesConnectorMetadata:
        meta = ExampleHiddenStatesConnectorMetadata()
        meta.pending_saves = list(self._pending_saves.values())
        self._pending_saves.clear()
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = new_req.sampling_params.extra_args if new_req.sampling_params else None
            target = marked_target(
                (extra or {}).get("kv_transfer_params"), len(self._plan.capture_ids)
            )
            if isinstance(target, Target):
                self._targets[new_req.req_id] = target
                if target.note:
                    log.warning(
                        "hsx: request %s dumped as bfloat16 (the client quantizes): %s",
                        new_req.req_id,
                        target.note,
                    )
            elif isinstance(target, str):
                log.warning("hsx: request %s not dumped: %s", new_req.req_id, target)
        return meta

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        target = self._targets.pop(request.request_id, None)
        if target is None:
            return False, None  # an ordinary request: its blocks are freed as usual
        self._pending_saves[request.request_id] = PendingSave(
            req_id=request.request_id,
            filename=target.path,
            token_ids=torch.tensor(list(request.prompt_token_ids or [])),
            block_ids=list(block_ids),
        )
        return True, {PARAM_NS: target.ns, PARAM_RID: target.rid}

    # -- worker side ----------------------------------------------------------------------

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        self._submitted.add(pending.req_id)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = int(pending.token_ids.shape[0])
        target = parse_target_path(pending.filename)
        host, copied = self._rows_to_host(slots, num_tokens, target.storage)
        future = self._executor.submit(self._write, target, host, copied, num_tokens)
        self._req_copy_events[pending.req_id] = copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req=pending.req_id: self._on_write_done(req, f))

    def _rows_to_host(
        self, slots: torch.Tensor, num_tokens: int, storage: Storage
    ) -> tuple[list[torch.Tensor], Any]:
        """The part's bytes on the host (the ``[T, L, H]`` bfloat16 rows, or their FP8
        sections), and what says the copy is done."""
        cache = self._kv_cache
        assert cache is not None
        if not cache.is_cuda:
            return _sections(extract_from_kv_cache(cache, slots, num_tokens), storage), _Copied()
        stream = self._get_copy_stream()
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            rows = extract_from_kv_cache(
                cache, slots.to(cache.device, non_blocking=True), num_tokens
            )
            host = []
            for section in _sections(rows, storage):
                buffer = torch.empty_like(section, device="cpu", pin_memory=True)
                buffer.copy_(section, non_blocking=True)
                host.append(buffer)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(stream)
        return host, done

    def _write(
        self, target: Target, host: list[torch.Tensor], copied: Any, num_tokens: int
    ) -> None:
        copied.synchronize()
        sections = [t.numpy() for t in host]  # uint8 [T, row bytes]: bf16 is little-endian
        report = write_dump(self._config, target, sections, num_tokens=num_tokens, plan=self._plan)
        for reject in report.rejects:
            log.error("hsx: no dump for rid %s: %s", reject.rid, reject.reason)
