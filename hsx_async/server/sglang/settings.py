"""The SGLang settings the hsx hook depends on, and every one that would make dumps wrong
or missing, each with its fix (checked once, when the hook installs)."""

from __future__ import annotations

from dataclasses import dataclass

from hsx_async.errors import ConfigError
from hsx_async.server.hook_core import ENV_AUX_LAYERS, HookConfig
from hsx_async.server.sglang.releases import SERVER_CAPTURE_FROM, CapturePath


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The SGLang settings the hook depends on, as the glue read them from the server."""

    radix_cache: bool
    attn_dp_size: int
    pp_size: int
    two_batch_overlap: bool
    moe_a2a_backend: str
    aux_capture: str | None
    aux_layer_ids_flag: tuple[int, ...] | None
    disaggregation_mode: str
    attn_tp_size: int = 1
    # Whose aux capture (hsx_async.server.sglang.releases): SGLang's (0.5.23 on), or the
    # hook's own, which needs no speculative algorithm (and refuses one).
    capture: CapturePath = "server"
    speculative_algorithm: str | None = None


def server_problems(settings: ServerSettings, config: HookConfig) -> list[str]:
    """Every setting that would make dumps wrong or missing, each with its fix."""
    problems: list[str] = []
    if settings.radix_cache:
        problems.append(
            "add --disable-radix-cache: a prefix-cache hit skips the cached rows of a prompt"
        )
    if settings.attn_dp_size > 1 and settings.attn_tp_size > 1:
        # Each DP rank pads its tokens to a multiple of the attention-TP size, and later
        # chunks of a long prompt keep the pad rows: their rows would not match.
        problems.append(
            f"DP attention with attention-TP size {settings.attn_tp_size} (attention DP "
            f"size {settings.attn_dp_size}) is not supported: pad rows shift later chunks. "
            "Give --dp-size equal to --tp-size (attention-TP size 1, e.g. --tp 8 --dp 8 "
            "--enable-dp-attention), or drop --enable-dp-attention"
        )
    if settings.pp_size > 1:
        problems.append(
            f"pipeline parallelism is not supported (--pp-size {settings.pp_size}): only the "
            "last stage sees the aux layers"
        )
    if settings.two_batch_overlap:
        problems.append("drop --enable-two-batch-overlap: it splits a pass into micro-batches")
    if settings.moe_a2a_backend.startswith("deepep"):
        problems.append(
            f"--moe-a2a-backend {settings.moe_a2a_backend} is not supported (DeepEP): use "
            "the default all-to-all backend"
        )
    if settings.disaggregation_mode not in ("null", "none", ""):
        problems.append(
            f"PD disaggregation (--disaggregation-mode {settings.disaggregation_mode}) is "
            "not supported: its prefill results bypass the hooked processor"
        )
    problems.extend(_aux_capture_problems(settings, config))
    return problems


def _aux_capture_problems(settings: ServerSettings, config: HookConfig) -> list[str]:
    if settings.capture == "hook":
        return _hook_capture_problems(settings)
    if settings.aux_capture is None:
        return [
            "add --enable-return-aux-hidden-states --speculative-algorithm EAGLE3: without "
            "aux capture the forward keeps no aux layers"
        ]
    problems = []
    if settings.aux_capture != "eagle3":
        problems.append(
            f"aux capture convention is {settings.aux_capture!r}: use "
            "--speculative-algorithm EAGLE3 with --enable-return-aux-hidden-states"
        )
    flag = settings.aux_layer_ids_flag
    if flag is not None and len(flag) != len(config.aux_layers):
        problems.append(
            f"--return-aux-hidden-state-layer-ids names {len(flag)} layers but "
            f"{ENV_AUX_LAYERS} names {len(config.aux_layers)}: drop the flag, the hook sets "
            "the captured layers itself"
        )
    return problems


def _hook_capture_problems(settings: ServerSettings) -> list[str]:
    """The hook's own capture path (SGLang before 0.5.23)."""
    problems = []
    if settings.speculative_algorithm not in (None, "", "NONE", "none"):
        problems.append(
            f"drop --speculative-algorithm {settings.speculative_algorithm} (and its draft "
            f"model): this SGLang (before {SERVER_CAPTURE_FROM}) has no capture-only aux "
            "mode, so the hsx hook turns the model's aux capture on itself, without a draft"
        )
    if settings.attn_dp_size > 1:
        # Run against a Hugging Face forward on 0.5.23 only: 0.5.14's DP attention does not
        # run on a CPU (it pins host memory), so the hook's own path was never run under it.
        problems.append(
            f"DP attention (attention DP size {settings.attn_dp_size}) with the hsx hook is "
            f"checked from SGLang {SERVER_CAPTURE_FROM} on: use it there, or drop "
            "--enable-dp-attention on this release"
        )
    return problems


def check_server_settings(settings: ServerSettings, config: HookConfig) -> None:
    """Refuse to start on a server whose settings break dumps (all problems in one error)."""
    problems = server_problems(settings, config)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(
            "", f"the hsx hook cannot dump hidden states from this SGLang server:\n{lines}"
        )
