"""The vLLM side of hsx, without vLLM: which requests are marked, which layers vLLM must
capture, and one request's dump written as PROTOCOL §3 says, through the engine interface
every hook implements (``hsx_async/server/README.md``).

How vLLM gives hidden states: with the ``extract_hidden_states`` speculative method, the
target model hands the residual stream at the layer ids ``eagle_aux_hidden_state_layer_ids``
(id k = the stream entering decoder layer k = Hugging Face ``hidden_states[k]``; id n, for
an n-layer model, is the output of the last layer *before* the final norm) to a
cache-only attention layer, which stores ``[tokens, ids, hidden]`` in paged KV-cache blocks.
A KV connector reads a finished request's rows back from those blocks. So hsx asks vLLM for
``aux_layers + [n]``, and the dump's last layer is the **pre-norm** final state: meta.json
says ``"final_state": "pre_norm"`` (the SGLang hook writes the post-norm state). Prefix
caching must be off: a request that reused cached blocks would carry another request's
rows.

A marked request carries ``kv_transfer_params = {"hsx_ns": ns, "hsx_rid": rid}``
(vLLM passes a completion request's ``kv_transfer_params`` to the connector); both are
checked against the protocol patterns before any path is built from them. It may add
``hsx_dtype``/``hsx_quantized`` (PROTOCOL §2): the connector then quantizes the rows on the
device before their copy to the host and writes the FP8 sections; an unusable request is
dumped as bfloat16 (the client quantizes it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsx_async.errors import ConfigError, DumpError, HsxRequestError
from hsx_async.protocol import (
    BF16_STORAGE,
    CUSTOM_PARAM_NS,
    Storage,
    check_aux_layers,
    check_hsx_request,
    parse_storage,
    requested_storage,
    valid_ns,
    valid_rid,
)
from hsx_async.server.dumper import BatchReport, PrefillDumper
from hsx_async.server.hook_core import HookConfig, ReqView
from hsx_async.server.hooks import HOOKS
from hsx_async.server.rows import EncodedPass

# kv_transfer_params keys of a marked request (PROTOCOL §2, vLLM form).
PARAM_NS = CUSTOM_PARAM_NS
PARAM_RID = "hsx_rid"
FINAL_STATE = HOOKS["vllm"].final_state  # the pre-norm state (see above)


@dataclass(frozen=True, slots=True)
class Target:
    """Where one marked request's dump goes, and how its rows are stored (``note``: why
    an FP8 request is dumped as bfloat16 instead)."""

    ns: str
    rid: str
    storage: Storage = BF16_STORAGE
    note: str = ""

    @property
    def path(self) -> str:
        """What travels from vLLM's scheduler to its worker (``PendingSave.filename``):
        ``ns/rid``, then ``/dtype:slots:scales`` for FP8."""
        if not self.storage.is_fp8:
            return f"{self.ns}/{self.rid}"
        slots = ",".join(map(str, self.storage.quantized))
        return f"{self.ns}/{self.rid}/{self.storage.dtype}:{slots}:{self.storage.scales}"


def parse_target_path(text: str) -> Target:
    """The inverse of :attr:`Target.path` (DumpError for anything else)."""
    parts = text.split("/")
    if len(parts) not in (2, 3) or not (valid_ns(parts[0]) and valid_rid(parts[1])):
        raise DumpError(f"dump target {text!r} is not ns/rid[/dtype:slots:scales]")
    if len(parts) == 2:
        return Target(parts[0], parts[1])
    dtype, _, rest = parts[2].partition(":")
    slots, _, scales = rest.partition(":")
    try:
        quantized = [int(x) for x in slots.split(",")]
    except ValueError:
        raise DumpError(f"dump target {text!r} names no quantized slots") from None
    where = f"dump target {text!r}"
    return Target(parts[0], parts[1], parse_storage(dtype, quantized, where, scales or None))


def marked_target(params: object, layers: int = 0) -> Target | str | None:
    """The dump target of a request's ``kv_transfer_params``: a :class:`Target`; ``None``
    for an ordinary request (no hsx keys: served as usual, nothing dumped); or the reason
    a marked request is refused (nothing is written for it). ``layers`` (L, the capture
    ids) checks the storage it asks for; 0 dumps every request as bfloat16."""
    if not isinstance(params, Mapping) or (PARAM_NS not in params and PARAM_RID not in params):
        return None
    try:
        # The vLLM form has no prefill-only field: its one sampled token never runs
        # through the model (PROTOCOL §2).
        ns, rid = check_hsx_request(params.get(PARAM_NS), params.get(PARAM_RID))
    except HsxRequestError as exc:
        return str(exc)
    storage, note = requested_storage(dict(params), layers) if layers else (BF16_STORAGE, "")
    return Target(ns, rid, storage, note)


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """The layers the connector was started for."""

    aux_layers: tuple[int, ...]
    num_layers: int
    hidden_size: int

    @property
    def capture_ids(self) -> tuple[int, ...]:
        """What ``eagle_aux_hidden_state_layer_ids`` must be: the aux layers, then n."""
        return (*self.aux_layers, self.num_layers)


def layer_plan(capture_ids: Sequence[int] | None, num_layers: int, hidden_size: int) -> LayerPlan:
    """Check vLLM's ``eagle_aux_hidden_state_layer_ids`` and derive the aux layers.

    The ids must be the aux layers, by the one aux-layer rule (vLLM sorts and
    de-duplicates the ids, so they must be strictly ascending as given), followed by n, the
    final state of this n-layer model: the dump then holds L = aux + 1 layers."""
    key = "speculative-config eagle_aux_hidden_state_layer_ids"
    ids = list(capture_ids or [])
    if len(ids) < 2 or ids[-1] != num_layers:
        example = f"[2, {num_layers // 2}, {num_layers - 3}, {num_layers}]"
        raise ConfigError(
            key,
            f"is {ids}; hsx needs the aux layers followed by {num_layers} (the final state "
            f"of this {num_layers}-layer model), e.g. {example}",
        )
    aux = check_aux_layers(ids[:-1], key=key, num_layers=num_layers)
    return LayerPlan(aux, num_layers, hidden_size)


def check_prefix_caching(enabled: bool) -> None:
    if enabled:
        raise ConfigError(
            "vllm",
            "prefix caching is on: a cache hit would dump another request's rows. Start "
            "vLLM with --no-enable-prefix-caching",
        )


def hook_config(root: Path, plan: LayerPlan, *, model: str, server: str) -> HookConfig:
    """The hook settings of a connector: the dump root read from ``HSX_DUMP_ROOT``
    (:func:`~hsx_async.server.hook_core.dump_root_from_env`), the layers vLLM captures."""
    return HookConfig(dump_root=root, aux_layers=plan.aux_layers, model=model, server=server)


def write_dump(
    config: HookConfig,
    target: Target,
    sections: Sequence[np.ndarray],
    *,
    num_tokens: int,
    plan: LayerPlan,
) -> BatchReport:
    """One finished request's dump, through the dumper every hook uses: vLLM hands over a
    request's rows at once, so it is one pass holding one request whose one chunk is the
    whole prompt (part ``[0, num_tokens)``, then ``meta.json``). ``sections``: the host
    bytes of the part's sections, each ``uint8`` ``[num_tokens, row bytes]`` (the bfloat16
    rows, or the FP8 sections of :func:`hsx_async.quantize.encode_rows`). Returns the
    dumper's report: a refused dump is in its ``rejects``, with the reason."""
    view = ReqView(
        rid=target.rid,
        ns=target.ns,
        num_tokens=num_tokens,
        max_new_tokens=0,  # the vLLM form has no prefill-only field (see marked_target)
        start=0,
        rows=num_tokens,
        storage=target.storage,
    )
    rows = EncodedPass(
        storage=target.storage,
        sections=tuple(sections),
        aux_layers=plan.aux_layers,
        hidden_size=plan.hidden_size,
    )
    # A dumper per request: the connector's writer threads share no bookkeeping, and a
    # finished request has no later chunk for a registry to follow.
    return PrefillDumper(config, final_state=FINAL_STATE).dump_batch([view], lambda: rows)
