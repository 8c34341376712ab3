"""The target model, as the exports need it: its family, its depth and its final norm.

A dataset's last layer slot holds one kind of final hidden state (PROTOCOL §4): the output
of the model's final RMSNorm (``post_norm``, what SGLang's LM head reads) or its input
(``pre_norm``). Trainers disagree on which they want — SpecForge 0.2.0 applies only the LM
head to it, speculators 0.9.0 applies ``lm_head(norm(x))`` itself — so an export turns one
kind into the other with the model's final norm:

- ``post = g ⊙ x / rms(x)`` with ``rms(x) = sqrt(mean(x²) + eps)`` and the gain ``g = w``
  (``rms``: Llama, Qwen2/3, DeepSeek, …) or ``g = 1 + w`` (``rms_one_plus``: Gemma,
  Qwen3.5/Qwen3-Next, whose norms store ``w`` around 0);
- back: ``post / g`` is ``x / rms(x)``, which is not ``x`` but has the same direction and
  rms 1, so ``norm(post / g) == post`` up to ``eps`` and bfloat16 rounding: the trainer's
  ``lm_head(norm(·))`` gives the target's own logits. A channel whose gain is exactly 0
  carries nothing after the norm either way; it is exported as 0.

Only ``config.json`` and the one final-norm tensor are read (``safetensors``, no model
load); torch is imported inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from safetensors import safe_open

from hsx_async.errors import DatasetError
from hsx_async.layer_ids import architecture_of, num_layers_of
from hsx_async.protocol import POST_NORM, PRE_NORM, RMS_ONE_PLUS, final_norm_kind

if TYPE_CHECKING:
    import torch

# Where checkpoints keep the decoder's final norm, most common first.
FINAL_NORM_NAMES = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
    "model.decoder.norm.weight",
    "norm.weight",
)
DEFAULT_EPS = 1e-6


@dataclass(frozen=True)
class TargetModel:
    """What ``config.json`` of a local Hugging Face directory says about the model."""

    path: Path
    architecture: str | None
    num_layers: int | None
    hidden_size: int | None
    norm_kind: str
    norm_eps: float

    @property
    def final_norm(self) -> dict[str, Any]:
        """The ``final_norm`` record of provenance.json (PROTOCOL §4)."""
        return {"kind": self.norm_kind, "eps": self.norm_eps}


def _text_scope(config: Mapping[str, Any]) -> Mapping[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def read_config(path: Path) -> dict[str, Any]:
    """``config.json`` of a model directory, or a one-line error naming what to fix."""
    file = path / "config.json"
    try:
        raw = orjson.loads(file.read_bytes())
    except FileNotFoundError:
        raise DatasetError(
            f"--model {path}: no config.json there; give the target model's local Hugging "
            "Face directory"
        ) from None
    except orjson.JSONDecodeError as exc:
        raise DatasetError(f"--model {path}: config.json is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise DatasetError(f"--model {path}: config.json is not a JSON object")
    return raw


def describe_target(path: Path, config: Mapping[str, Any]) -> TargetModel:
    text = _text_scope(config)
    model_type = text.get("model_type", config.get("model_type"))
    eps = text.get("rms_norm_eps", text.get("layer_norm_eps", DEFAULT_EPS))
    hidden = text.get("hidden_size")
    return TargetModel(
        path=path,
        architecture=architecture_of(config),
        num_layers=num_layers_of(config),
        hidden_size=hidden if isinstance(hidden, int) else None,
        norm_kind=final_norm_kind(model_type),
        norm_eps=float(eps) if isinstance(eps, int | float) else DEFAULT_EPS,
    )


def read_target(path: Path) -> TargetModel:
    return describe_target(path, read_config(path))


def _weight_files(path: Path) -> list[tuple[Path, str | None]]:
    """(file, tensor name) pairs to look in: the index names the shard of each tensor."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = orjson.loads(index.read_bytes()).get("weight_map", {})
        except (orjson.JSONDecodeError, AttributeError):
            raise DatasetError(f"--model {path}: {index.name} is not a valid index") from None
        return [(path / weight_map[n], n) for n in FINAL_NORM_NAMES if n in weight_map]
    return [(f, None) for f in sorted(path.glob("*.safetensors"))]


def final_norm_weight(target: TargetModel) -> torch.Tensor:
    """The final norm's stored ``w`` (float32, ``[H]``), read alone from the checkpoint."""
    for file, name in _weight_files(target.path):
        with safe_open(str(file), framework="pt") as handle:
            keys = set(handle.keys())
            for candidate in (name,) if name else FINAL_NORM_NAMES:
                if candidate in keys:
                    weight: torch.Tensor = handle.get_tensor(candidate).float()
                    _check_weight(target, weight, candidate)
                    return weight
    raise DatasetError(
        f"--model {target.path}: no final-norm weight ({', '.join(FINAL_NORM_NAMES)}) in its "
        "safetensors files"
    )


def _check_weight(target: TargetModel, weight: torch.Tensor, name: str) -> None:
    if weight.dim() != 1 or (target.hidden_size and weight.shape[0] != target.hidden_size):
        raise DatasetError(
            f"--model {target.path}: {name} has shape {list(weight.shape)}, expected "
            f"[{target.hidden_size}]"
        )


def norm_gain(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """The per-channel factor the norm multiplies by: ``w`` or ``1 + w``."""
    return weight + 1.0 if kind == RMS_ONE_PLUS else weight


def pre_from_post(post: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """``post / g`` in float32, 0 where ``g == 0``; bfloat16 out (see the module text)."""
    # torch here only: `hsx check`/`hsx run` read the model's config through this module
    # (read_config), and a bf16 run never imports torch (tests/run/dumps/test_writer.py).
    import torch  # noqa: PLC0415

    out = post.float() / gain
    return torch.where(gain == 0, torch.zeros_like(out), out).to(torch.bfloat16)


def post_from_pre(pre: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's final RMSNorm applied to ``pre`` in float32; bfloat16 out."""
    import torch  # noqa: PLC0415 - see pre_from_post

    x = pre.float()
    scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x * scale * gain).to(torch.bfloat16)


def convert_final(
    final: torch.Tensor, have: str, want: str, gain: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """The final state ``[T, H]`` as the kind ``want``; unchanged when it already is."""
    if have == want:
        return final
    if gain is None:
        raise DatasetError(f"converting the {have} final state to {want} needs the final norm")
    if have == POST_NORM and want == PRE_NORM:
        return pre_from_post(final, gain)
    return post_from_pre(final, gain, eps)
