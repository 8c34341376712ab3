"""The tiny DeepSeek-V3 of the real-SGLang tier: Kimi-K2.5's own architecture, small.

Kimi-K2.5 runs in SGLang as ``DeepseekV3ForCausalLM`` (inside
``KimiK25ForConditionalGeneration``): MLA attention with LoRA-compressed queries and a latent
KV cache, MoE layers of sigmoid-scored routed experts plus a shared expert (``noaux_tc``
routing with an ``e_score_correction_bias``), YaRN rope. This model has all of it at hidden
size 256 with Kimi-K2's layout (layer 0 dense, every later layer MoE, one expert group),
so a hook or numbering bug that only DeepSeek's code path has shows here.

What the checkpoint needs so that SGLang 0.5.23 loads it (``shared/REAL-ENGINES.md``):
YaRN rope parameters (SGLang's CPU rope has only ``deepseek_yarn``); ``moe_layer_freq``,
``scoring_func`` and ``topk_method``, which SGLang reads and Hugging Face's config class
drops, set on the saved ``config.json``; and ``e_score_correction_bias``, a buffer that the
default init leaves at zero, given small random values.

Test models must not hide bugs: every norm gain (the MLA ``q_a_layernorm`` and
``kv_a_layernorm`` too) is drawn per channel from U(0.2, 3), so a pre-/post-norm mix-up
shows; and the residual stream carries massive activations as trained models do (a few
fixed channels hundreds of times the median at the first token and at delimiter tokens,
a few moderately large channels at every token), so the dumps are not Gaussian noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

from hsx_async.server.reference.model import TINY_VOCAB, set_realistic_norm_gains

ARCHITECTURE = "DeepseekV3ForCausalLM"
KIMI_ARCHITECTURE = "KimiK25ForConditionalGeneration"  # SGLang builds a DeepseekV3 inside
HIDDEN = 256
LAYERS = 6
# The dataset's aux layers (hsx numbering: the residual stream entering layer k). Under
# DeepSeek's draft-config rule (+1 only when the first id is 1) a first aux layer of 1 has
# no ids at all, so the tier uses 2: layers after the dense layer and after MoE layers.
AUX_LAYERS = (2, 3, 5)
# Massive activations (Sun et al., "Massive Activations in Large Language Models", 2024):
# in trained models a few fixed channels of the residual stream reach 1,000-10,000x the
# median at the first token and at some delimiter tokens (attention sinks), and a few other
# channels are moderately large at every token. Put in through the embedding, they stay in
# the residual stream of every layer.
MASSIVE_CHANNELS = (57, 198)
BOS = 0  # <s>
DELIMITER = 3  # "t0", the tiny vocabulary's stand-in for a newline
SINK_TOKENS = {BOS: 10000.0, DELIMITER: 2000.0}  # x the embedding's median magnitude
OUTLIER_CHANNELS = (11, 90, 140, 233)
OUTLIER_SCALE = 100.0
LM_HEAD_DAMPING = 0.01

# Everything SGLang's DeepSeek path reads. Kimi-K2's choices where it has them (one expert
# group, layer 0 dense, routed_scaling_factor 2.827, rope theta 50000, mscale 1).
CONFIG: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
# Read by SGLang, dropped by transformers' DeepseekV3Config: written into config.json.
SGLANG_ONLY_CONFIG = {"moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
BIAS_SCALE = 0.05  # e_score_correction_bias ~ U(-0.05, 0.05); sigmoid scores are ~0.5


def build_model(seed: int = 0) -> Any:
    """The model in float32, from ``seed`` (the caller's RNG state is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG))
        set_realistic_norm_gains(model)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.uniform_(-BIAS_SCALE, BIAS_SCALE)
            add_massive_activations(model.model.embed_tokens.weight)
            # A trained LM head reads little of those channels (they carry no token
            # information); left at full weight they alone would pick every next token.
            model.lm_head.weight[:, [*MASSIVE_CHANNELS, *OUTLIER_CHANNELS]] *= LM_HEAD_DAMPING
    return model.float().eval()


def add_massive_activations(embed: torch.Tensor) -> None:
    """Sink tokens get ``±scale x`` the embedding's median magnitude in the massive channels
    (opposite signs, as often seen); every token gets a fixed offset of ``OUTLIER_SCALE x``
    in the outlier channels."""
    median = float(embed.abs().median())
    signs = torch.tensor([1.0, -1.0])
    for token, scale in SINK_TOKENS.items():
        embed[token, list(MASSIVE_CHANNELS)] = signs * scale * median
    gen = torch.Generator().manual_seed(len(OUTLIER_CHANNELS))
    offsets = torch.randn(len(OUTLIER_CHANNELS), generator=gen).sign() * OUTLIER_SCALE * median
    embed[:, list(OUTLIER_CHANNELS)] += offsets


def save_model(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """The model as a local Hugging Face directory (bfloat16 weights, as checkpoints ship),
    with the tiny vocabulary's tokenizer copied from ``tokenizer_dir``."""
    path.mkdir(parents=True, exist_ok=True)
    build_model(seed).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(SGLANG_ONLY_CONFIG)
    config_file.write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def load_reference(path: Path) -> Any:
    """The saved (bfloat16) weights through transformers in float32: the ground truth."""
    model: Any = DeepseekV3ForCausalLM.from_pretrained(
        path, dtype=torch.float32, local_files_only=True
    )
    return model.eval()
