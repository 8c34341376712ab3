"""What moved between the SGLang releases of the range, and how the hook's glue meets each.

**Two capture paths.** The hook needs, for every token of a marked request's prefill
passes, the aux layers and the final hidden state after the final norm (the LM head's
input: ``docs/PROTOCOL.md``).

- ``"server"`` (from :data:`SERVER_CAPTURE_FROM`): SGLang's own capture-only aux mode
  (``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3``, no draft model)
  turns the model's EAGLE-3 capture on, and its logits processor keeps the post-norm final
  state beside the aux layers (``LogitsProcessorOutput.last_hidden_states``).
- ``"hook"`` (0.5.14-0.5.22: neither exists there): the hook does the same itself, in each
  scheduler process (:mod:`hsx_async.server.sglang.capture`): before the first forward it
  turns the model's capture on with SGLang's own ``set_eagle3_layers_to_capture`` (what
  the server flag calls), a forward that carries a marked request runs in full capture
  mode, and ``LogitsProcessor.forward``'s ``hidden_states`` argument (the output of the
  final norm, which the LM head reads) is kept on its output as ``last_hidden_states``.
  The launch flags are then the plain ones (no speculative algorithm).

**Server settings** come from ``srt/runtime_context.py``'s groups where the release has
``srt/arg_groups/fields/`` (0.5.20 on), else from ``ServerArgs`` (0.5.14-0.5.19:
``get_global_server_args()``, which 0.5.20 on make raise).

**Smaller moves**, met by the glue where they are read: ``Req.discard_output_reason``
(0.5.22 on; absent: no such abort), ``LogitsProcessorOutput.hidden_states_token_indices``
(0.5.21 on; absent: every row is captured), ``sglang.srt.utils.common.async_d2h`` (0.5.21
on; before, SGLang's own ``copy_to_cpu`` copies with ``.to("cpu", non_blocking=True)``,
and so does the glue).

Pure (no SGLang import at module level): ``launch.sh`` and the drift checker use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from hsx_async.server.engine_versions import release_of, version_key

CapturePath = Literal["server", "hook"]

# The first release with the capture-only aux mode and the kept post-norm final state.
SERVER_CAPTURE_FROM = "0.5.23"
# What the server path adds to the launch command (deploy/sglang/launch.sh asks for them).
SERVER_CAPTURE_FLAGS = ("--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3")


def capture_path(version: str) -> CapturePath:
    """The path the hook takes on ``version`` (a build tag is its release)."""
    try:
        newer = version_key(release_of(version)) >= version_key(SERVER_CAPTURE_FROM)
    except TypeError:  # (a version not like x.y.z: only under HSX_ALLOW_SGLANG_VERSION)
        newer = True
    return "server" if newer else "hook"


def capture_flags(path: CapturePath) -> tuple[str, ...]:
    """The ``sglang.launch_server`` flags the path needs."""
    return SERVER_CAPTURE_FLAGS if path == "server" else ()


@dataclass(frozen=True, slots=True)
class RawSettings:
    """The server settings the hook checks, as one release spells them."""

    radix_cache: bool
    two_batch_overlap: bool
    moe_a2a_backend: str
    disaggregation_mode: str
    served_model_name: str | None
    speculative_algorithm: str | None
    aux_capture: str | None = None
    aux_layer_ids_flag: tuple[int, ...] | None = None


def read_grouped_settings(rc: Any, *, server_capture: bool) -> RawSettings:
    """0.5.20 on: the settings from ``srt/runtime_context.py``'s groups."""
    exec_ = rc.get_exec()
    features = exec_.features
    layer_ids = features.return_aux_hidden_state_layer_ids if server_capture else None
    spec = None if server_capture else _name(rc.get_spec().speculative_algorithm)
    return RawSettings(
        radix_cache=not rc.get_memory().disable_radix_cache,
        two_batch_overlap=bool(exec_.overlap.enable_two_batch_overlap),
        moe_a2a_backend=str(exec_.moe.moe_a2a_backend),
        disaggregation_mode=_mode(rc.get_disagg().disaggregation_mode),
        served_model_name=_name(rc.get_serving().served_model_name),
        speculative_algorithm=spec,
        aux_capture=features.aux_hidden_state_capture if server_capture else None,
        aux_layer_ids_flag=None if layer_ids is None else tuple(layer_ids),
    )


def read_flat_settings(args: Any) -> RawSettings:
    """0.5.14-0.5.19: the settings from ``ServerArgs`` (``get_global_server_args()``)."""
    return RawSettings(
        radix_cache=not args.disable_radix_cache,
        two_batch_overlap=bool(args.enable_two_batch_overlap),
        moe_a2a_backend=str(args.moe_a2a_backend),
        disaggregation_mode=_mode(args.disaggregation_mode),
        served_model_name=_name(args.served_model_name),
        speculative_algorithm=_name(args.speculative_algorithm),
    )


def _mode(mode: object) -> str:
    return str(getattr(mode, "value", mode))


def _name(value: object) -> str | None:
    return str(value) if value else None


def host_copy(tensor: Any) -> Any:
    """A device tensor's copy to the host the way SGLang's ``copy_to_cpu`` makes it before
    0.5.21 (no ``async_d2h``): queued on the current stream, which the result's
    ``copy_done`` event, recorded after, covers. A host tensor is returned as it is."""
    return tensor.to("cpu", non_blocking=True)


def load_async_d2h() -> Callable[[Any], Any]:
    """SGLang's ``async_d2h`` (0.5.21 on), else :func:`host_copy`."""
    try:
        from sglang.srt.utils.common import async_d2h  # noqa: PLC0415 (SGLang: in the engine)
    except ImportError:
        return host_copy
    return async_d2h  # type: ignore[no-any-return]
