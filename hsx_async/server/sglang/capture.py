"""The hook's own capture path (:mod:`hsx_async.server.sglang.releases`: SGLang 0.5.14-0.5.22,
which have no capture-only aux mode and keep no post-norm final state): in each scheduler
process the hook does what ``--enable-return-aux-hidden-states`` does in 0.5.23.

- :func:`enable_model_capture`, before the first forward: the model's EAGLE-3 aux capture
  turned on with SGLang's own ``set_eagle3_layers_to_capture`` (as 0.5.23's
  ``configure_aux_hidden_state_capture`` does, with no draft model); the hook then sets the
  captured layers to ``HSX_AUX_LAYERS`` as on every release.
- :func:`mark_full_capture`, at every forward: a pass that carries a marked request runs
  in full capture mode (``ForwardBatch.capture_hidden_mode``), so the logits processor
  stores the aux layers of every row (not only the last), without the requests'
  ``return_hidden_states`` (nothing goes into a response).
- :func:`wrap_logits_forward`: ``LogitsProcessor.forward``'s ``hidden_states`` argument is
  the output of the model's final norm, the LM head's input: where the aux layers are
  stored in full, it is kept on the output as ``last_hidden_states``, the field 0.5.23
  fills itself. A model that hands the processor a pre-norm state
  (``hidden_states_before_norm``) gets none kept: its passes are refused, never dumped
  with the wrong final state.

Pure torch-free glue over duck-typed SGLang objects (the tests drive it with stand-ins).
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

from hsx_async.errors import ConfigError
from hsx_async.server.hook_core import ENV_AUX_LAYERS

Wrapper = Callable[..., Any]
# The attribute 0.5.23's LogitsProcessorOutput has and the hook's path fills before it.
FINAL_STATE_ATTR = "last_hidden_states"
# Each request's (start, rows) in the pass, by ForwardBatch's host lists: 0.5.14's overlap
# scheduler hands the result processor a batch copy without prefix_lens and extend_lens.
PASS_LAYOUT_ATTR = "_hsx_pass_layout"
_SWITCH = "capture_aux_hidden_states"
_SETTER = "set_eagle3_layers_to_capture"


def enable_model_capture(model: Any) -> bool:
    """Turn ``model``'s EAGLE-3 aux capture on; returns whether it was on already (then
    the CUDA graphs were recorded capturing; else they were recorded without it)."""
    was_on = any(getattr(m, _SWITCH, False) is True for m in _modules(model))
    setter = getattr(model, _SETTER, None)
    if not callable(setter):
        raise ConfigError(
            ENV_AUX_LAYERS,
            f"{type(model).__name__} has no {_SETTER}: the hsx hook needs a model with "
            "EAGLE-3 aux capture",
        )
    if not was_on:
        setter(None)  # SGLang's default layers; the hook sets HSX_AUX_LAYERS after
    if not any(getattr(m, _SWITCH, False) is True for m in _modules(model)):
        raise ConfigError(
            ENV_AUX_LAYERS,
            f"{type(model).__name__}.{_SETTER} left no module with {_SWITCH} on: the hsx "
            "hook cannot turn the model's aux capture on",
        )
    return was_on


def _modules(model: Any) -> list[Any]:
    modules = getattr(model, "modules", None)
    return list(modules()) if callable(modules) else [model]


def mark_full_capture(batch: Any, marked: Container[object], full: object) -> bool:
    """Put a forward that carries a marked request (by ``ForwardBatch.rids``) in full
    capture mode; returns whether it did."""
    rids = getattr(batch, "rids", None)
    if not rids or not any(isinstance(r, str) and r in marked for r in rids):
        return False
    batch.capture_hidden_mode = full
    return True


def pass_layout(batch: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A forward's (prefix lengths, extend lengths) per request, None where it has none."""
    starts = getattr(batch, "extend_prefix_lens_cpu", None)
    rows = getattr(batch, "extend_seq_lens_cpu", None)
    if starts is None or rows is None or len(starts) != len(rows):
        return None
    return tuple(int(s) for s in starts), tuple(int(r) for r in rows)


def wrap_logits_forward(original: Wrapper, full: object) -> Wrapper:
    """``LogitsProcessor.forward`` keeping the post-norm final state next to full aux rows."""

    def forward(
        self: Any,
        input_ids: Any,
        hidden_states: Any,
        lm_head: Any,
        logits_metadata: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        out = original(self, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)
        aux = args[0] if args else kwargs.get("aux_hidden_states")
        before_norm = args[1] if len(args) > 1 else kwargs.get("hidden_states_before_norm")
        if out is None or getattr(logits_metadata, "capture_hidden_mode", None) != full:
            return out
        layout = pass_layout(logits_metadata)
        if layout is not None:
            setattr(out, PASS_LAYOUT_ATTR, layout)
        if (
            aux is not None
            and before_norm is None
            and getattr(out, "hidden_states", None) is not None
        ):
            setattr(out, FINAL_STATE_ATTR, hidden_states)
        return out

    return forward
