"""The reference server's model side: a real ``transformers`` causal LM on the CPU.

Two ways to get hidden states, which the tests hold equal:

* :func:`reference_hidden_states` — the ground truth: ONE plain forward of the whole prompt,
  unchunked and unbatched.
* :class:`PackedEngine` — what the server runs: like SGLang's ragged "extend" batches, the
  new rows of several requests are packed into one sequence, each attending only to its own
  KV cache (earlier chunks) and causally to its own new rows, through an explicit 4-D mask.

"Layer k" is the residual stream entering decoder layer k (``hidden_states[k]`` of a
``transformers`` forward, what SGLang's EAGLE-3 capture records); the last of the L layers
is the final post-norm hidden state, the input of the LM head (``last_hidden_state``).
Computation is float32; the conversion to bfloat16 happens once, at the end.

This module imports torch and transformers (seconds): :mod:`.reference` imports it only when
a server or the ground truth is needed, so ``hsx --help`` stays fast.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from hsx_async.errors import ConfigError
from hsx_async.protocol import check_aux_layers, final_norm_kind

# The built-in model: small enough that a 300-token forward takes ~70 ms on one core, big
# enough (GQA, 6 layers, RoPE) to exercise what real checkpoints do.
TINY_VOCAB = 1024
TINY_HIDDEN = 256
TINY_LAYERS = 6
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_INTERMEDIATE = 688
TINY_MAX_POSITIONS = 4096
TINY_AUX_LAYERS = (1, 3, 5)
# Per-channel RMSNorm gains of the built-in model (see set_realistic_norm_gains).
NORM_GAIN_LOW = 0.2
NORM_GAIN_HIGH = 3.0

# The tiny tokenizer's chat template (hsx prepare/regenerate): words of its vocabulary as
# role headers (t1000 system, t1001 user, t1002 assistant) and </s> ending each answer.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %} t1000 {{ m.content }}"
    "{% elif m.role == 'user' %} t1001 {{ m.content }}"
    "{% else %} t1002 {{ m.content }} </s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} t1002{% endif %}"
)

# One layer's cached (keys, values), each [1, kv_heads, rows, head_dim].
LayerKV = tuple[torch.Tensor, torch.Tensor]
KV = tuple[LayerKV, ...]


def default_model_name(seed: int) -> str:
    return f"hsx-tiny-llama-seed{seed}"


def build_default_model(seed: int = 0) -> Any:
    """The built-in tiny Llama: random weights drawn from ``seed``, no download, float32.

    The same seed gives the same weights in every process (the caller's RNG state is left
    untouched), so a test can rebuild the server's model on its own.
    """
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=TINY_INTERMEDIATE,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=TINY_HEADS,
        num_key_value_heads=TINY_KV_HEADS,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = LlamaForCausalLM(config)
        set_realistic_norm_gains(model)
    return model.float().eval()  # float32 even if a caller changed torch's default dtype


def set_realistic_norm_gains(
    model: Any, low: float = NORM_GAIN_LOW, high: float = NORM_GAIN_HIGH
) -> None:
    """Draw every RMSNorm gain per channel from U(low, high), from torch's current RNG.

    Random init leaves each gain at 1.0, and then norm(norm(x)) == norm(x): a pre-/post-norm
    mix-up (the final state normed twice, or not at all) would pass every comparison.
    Trained checkpoints have gains far from 1 (per channel, roughly 0.2–3).
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.uniform_(low, high)


def save_default_model(path: Path, seed: int = 0) -> Path:
    """Write the built-in tiny Llama as a local Hugging Face directory (bfloat16 weights,
    ``config.json``, and a word-level tokenizer over its vocabulary: ``t0`` … ``t1020`` and
    ``<s>``, ``</s>``, ``<unk>``, with :data:`TINY_CHAT_TEMPLATE`), so a real engine (SGLang,
    vLLM) can serve exactly the model the ground truth is computed from. Nothing is
    downloaded."""
    from tokenizers import Tokenizer  # noqa: PLC0415 - only writers of model dirs need it
    from tokenizers.models import WordLevel  # noqa: PLC0415
    from tokenizers.pre_tokenizers import WhitespaceSplit  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    path.mkdir(parents=True, exist_ok=True)
    model = build_default_model(seed)
    model.config.bos_token_id, model.config.eos_token_id = 0, 1
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    specials = ["<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"t{i}": i + len(specials) for i in range(TINY_VOCAB - len(specials))})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    # The ignores differ between tokenizers/transformers releases (typed or not).
    tok.pre_tokenizer = WhitespaceSplit()  # type: ignore[assignment, unused-ignore]
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=TINY_CHAT_TEMPLATE,
    )
    fast.save_pretrained(path)
    return path


def load_model(path: str) -> Any:
    """A local Hugging Face causal-LM directory, in float32 (never from a hub)."""
    if not Path(path).is_dir():
        raise ConfigError("model", f"{path!r} is not a directory holding a Hugging Face model")
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        raise ConfigError("model", f"cannot load a causal LM from {path!r}: {exc}") from None
    return model.eval()


def text_config(model: Any) -> Any:
    """The decoder's config (multimodal configs nest it)."""
    return model.config.get_text_config(decoder=True)


def default_aux_layers(num_hidden_layers: int) -> tuple[int, ...]:
    """SGLang's EAGLE-3 default (2, N/2, N-3) where it gives 3 distinct layers, else spread
    over the few there are: (1, 3, 5) for the 6-layer built-in model."""
    n = num_hidden_layers
    if n >= 8:
        return (2, n // 2, n - 3)
    return tuple(sorted({min(1, n - 1), n // 2, n - 1}))


def _stack_layers(out: Any, aux_layers: Sequence[int]) -> torch.Tensor:
    """[rows, L, H] float32 of batch row 0: the aux layers, then the post-norm final state.

    ``last_hidden_state`` rather than ``hidden_states[-1]``: it is post-norm in every
    transformers version, whatever a config says about tying the last hidden state.
    """
    layers = [out.hidden_states[k][0] for k in aux_layers]
    layers.append(out.last_hidden_state[0])
    return torch.stack(layers, dim=1)


def reference_hidden_states(
    model: Any, input_ids: Sequence[int] | np.ndarray[Any, Any], aux_layers: Sequence[int]
) -> torch.Tensor:
    """The ground truth: [T, L, H] bfloat16 from ONE unchunked, unbatched forward."""
    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))[None]
    with torch.inference_mode():
        out = model.base_model(input_ids=ids, use_cache=False, output_hidden_states=True)
        return _stack_layers(out, aux_layers).to(torch.bfloat16)


# "Equal to the ground truth" for bfloat16 hidden states computed another way (chunked,
# batched). Both sides do the same float32 math on different shapes (packed requests, a
# chunked KV cache, an explicit mask instead of the causal kernel), so sums run in another
# order and the float32 results differ by a few float32 ulps (measured: at most 1.4e-6 on
# values of order 1). Rounded to bfloat16 (8 significant bits) they are equal except where
# they straddle a rounding boundary; there they differ by exactly one bf16 ulp, at most
# 2^-7 of the value. Hence a relative tolerance of two bf16 ulps, an absolute one for values
# near 0 (where 1e-6 is many ulps), and most elements bit-identical (measured: >= 99.96%).
# A wrong row, layer, order or model misses both by far.
BF16_RTOL = 2 * 2.0**-7
BF16_ATOL = 1e-5
MIN_BIT_IDENTICAL = 0.99


def bf16_mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when ``got`` equals the ground truth ``want`` within bf16 rounding, else why not."""
    if got.dtype != torch.bfloat16 or want.dtype != torch.bfloat16:
        return f"dtypes are {got.dtype} and {want.dtype}, expected torch.bfloat16"
    if got.shape != want.shape:
        return f"shape is {tuple(got.shape)}, expected {tuple(want.shape)}"
    g, w = got.float(), want.float()
    close = torch.isclose(g, w, rtol=BF16_RTOL, atol=BF16_ATOL)
    if not bool(close.all()):
        first = tuple(int(i) for i in (~close).nonzero()[0])
        return (
            f"{int((~close).sum())} of {close.numel()} values differ by more than two bf16 "
            f"ulps; the first at {first}: {g[first].item()} instead of {w[first].item()}"
        )
    identical = float((got.view(torch.int16) == want.view(torch.int16)).double().mean())
    if identical < MIN_BIT_IDENTICAL:
        return f"only {identical:.4%} of the values are bit-identical"
    return None


def bf16_bytes(hidden: torch.Tensor) -> memoryview:
    """Raw little-endian bfloat16 bytes of a C-ordered tensor (PROTOCOL §3), no copy on x86."""
    array = hidden.contiguous().view(torch.int16).numpy()
    return array.astype("<i2", copy=False).data.cast("B")


@dataclass(frozen=True, slots=True)
class Segment:
    """New rows ``[start, start + len(tokens))`` of one request; ``past`` caches rows
    ``[0, start)``. ``want_next``: also return the greedy next token after the last row."""

    tokens: Sequence[int]
    start: int
    past: KV | None
    want_next: bool = False
    pick: Callable[[torch.Tensor], int] | None = None  # next token from logits; None: greedy


@dataclass(frozen=True, slots=True)
class SegmentOutput:
    hidden: torch.Tensor  # [rows, L, H] bfloat16
    kv: KV  # the request's cache, now of rows [0, start + rows)
    next_token: int | None


def packed_mask(query_lens: Sequence[int], past_lens: Sequence[int]) -> torch.Tensor:
    """Additive float mask [1, 1, Q, P + Q] for a packed pass.

    Keys are laid out as every segment's past (in segment order), then every segment's new
    rows; a query row sees its own segment's past and its own earlier new rows, nothing else.
    Every row sees at least itself, so no softmax row is empty.
    """
    q_total, p_total = sum(query_lens), sum(past_lens)
    allowed = torch.zeros(q_total, p_total + q_total, dtype=torch.bool)
    q0 = p0 = 0
    for n, p in zip(query_lens, past_lens, strict=True):
        allowed[q0 : q0 + n, p0 : p0 + p] = True
        own = slice(p_total + q0, p_total + q0 + n)
        allowed[q0 : q0 + n, own] = torch.ones(n, n, dtype=torch.bool).tril()
        q0, p0 = q0 + n, p0 + p
    # finfo.min rather than -inf: the convention of transformers' eager and sdpa paths.
    mask = torch.zeros(allowed.shape, dtype=torch.float32)
    mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


class PackedEngine:
    """Runs packed, chunk-continuing forward passes of one model (one pass at a time)."""

    def __init__(self, model: Any, aux_layers: Sequence[int]) -> None:
        self.model = model
        self.aux_layers = tuple(aux_layers)
        config = text_config(model)
        self.hidden_size: int = config.hidden_size
        self.num_hidden_layers: int = config.num_hidden_layers
        self.vocab_size: int = config.vocab_size
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.final_norm = {  # PROTOCOL §4's final_norm, for /get_model_info
            "kind": final_norm_kind(getattr(config, "model_type", None)),
            "eps": float(getattr(config, "rms_norm_eps", 1e-6)),
        }
        check_aux_layers(self.aux_layers, key="aux_layers", num_layers=self.num_hidden_layers)
        params = inspect.signature(model.base_model.forward).parameters
        # transformers 5 renamed past_key_values to cache (the old name warns).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def forward(self, segments: Sequence[Segment]) -> list[SegmentOutput]:
        for seg in segments:
            have = 0 if seg.past is None else seg.past[0][0].shape[2]
            if have != seg.start or not seg.tokens:
                raise ValueError(f"segment at row {seg.start} has a cache of {have} rows")
        query_lens = [len(s.tokens) for s in segments]
        past_lens = [s.start for s in segments]
        ids = torch.tensor([t for s in segments for t in s.tokens], dtype=torch.int64)[None]
        positions = torch.cat([torch.arange(s.start, s.start + len(s.tokens)) for s in segments])
        with torch.inference_mode():
            cache = self._packed_cache(segments)
            out = self.model.base_model(
                input_ids=ids,
                attention_mask=packed_mask(query_lens, past_lens),
                position_ids=positions[None],
                use_cache=True,
                output_hidden_states=True,
                **{self._cache_kw: cache},
            )
            hidden = _stack_layers(out, self.aux_layers).to(torch.bfloat16)
            next_tokens = self._next_tokens(segments, out.last_hidden_state[0])
            kvs = self._split_cache(cache, segments, sum(past_lens))
        outputs = []
        q0 = 0
        for seg, kv, nxt in zip(segments, kvs, next_tokens, strict=True):
            n = len(seg.tokens)
            outputs.append(SegmentOutput(hidden=hidden[q0 : q0 + n], kv=kv, next_token=nxt))
            q0 += n
        return outputs

    def _packed_cache(self, segments: Sequence[Segment]) -> Any:
        """A DynamicCache holding every segment's past, concatenated in segment order."""
        cache = DynamicCache()
        pasts = [s.past for s in segments if s.past is not None]
        if pasts:
            for layer in range(len(pasts[0])):
                keys = torch.cat([p[layer][0] for p in pasts], dim=2)
                values = torch.cat([p[layer][1] for p in pasts], dim=2)
                cache.update(keys, values, layer)
        return cache

    def _split_cache(self, cache: Any, segments: Sequence[Segment], p_total: int) -> list[KV]:
        """Each segment's past plus its new rows, cut back out of the packed cache."""
        per_layer = [_layer_kv(cache, i) for i in range(self.num_hidden_layers)]
        kvs: list[KV] = []
        q0 = p_total
        for seg in segments:
            n = len(seg.tokens)
            kv: list[LayerKV] = []
            for i, (keys, values) in enumerate(per_layer):
                new_k, new_v = keys[:, :, q0 : q0 + n], values[:, :, q0 : q0 + n]
                if seg.past is None:
                    # clone: a view would keep the whole packed cache of this pass alive.
                    kv.append((new_k.clone(), new_v.clone()))
                else:
                    kv.append(
                        (
                            torch.cat([seg.past[i][0], new_k], dim=2),
                            torch.cat([seg.past[i][1], new_v], dim=2),
                        )
                    )
            kvs.append(tuple(kv))
            q0 += n
        return kvs

    def _next_tokens(self, segments: Sequence[Segment], final: torch.Tensor) -> list[int | None]:
        """Greedy next token after the last row of the segments that want one."""
        ends: list[int] = []
        q0 = 0
        for seg in segments:
            q0 += len(seg.tokens)
            if seg.want_next:
                ends.append(q0 - 1)
        if not ends:
            return [None] * len(segments)
        logits = iter(self.model.get_output_embeddings()(final[ends]).float())
        picked: list[int | None] = []
        for seg in segments:
            if not seg.want_next:
                picked.append(None)
                continue
            row = next(logits)
            picked.append(int(row.argmax()) if seg.pick is None else seg.pick(row))
        return picked


def _layer_kv(cache: Any, layer: int) -> LayerKV:
    """Keys and values of one layer, across the cache layouts of transformers 4 and 5."""
    if hasattr(cache, "layers"):
        entry = cache.layers[layer]
        return entry.keys, entry.values
    return cache.key_cache[layer], cache.value_cache[layer]
