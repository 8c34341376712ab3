"""FP8 and attention sinks (issue 28): what one scale per vector does to a row with a few
massive channels, and what each layout keeps. A phase of ``bench/fp8.py`` (``--phases
sinks``); in process, no server.

Real models' attention-sink tokens (the first token, the first delimiter) carry a few
channels 1,000–30,000× the row's median in the residual stream. Scaled by them, the rest
of the row falls towards e4m3fn's subnormals, and the whole-vector error hides it (the
outlier is stored exactly, and it holds most of the energy). So the figures here are of
the *other* values of a row — the non-outlier channels:

- typical error: the median over them of ``|x̂ - x| / |x|`` (FP8 alone, float32);
- relative RMS error: ``‖x̂ - x‖ / ‖x‖`` over them, per vector, mean;
- subnormal share: of them, the share stored as e4m3fn subnormals or zero (an exact
  outlier entry is neither);

for sink rows and for ordinary rows, and each against an ordinary row's in the same
layout. Two sources:

1. **Kimi-shaped synthetic rows**: H 7168, 4 slots; the residual stream's shape (per-channel
   gains U(0.2, 3), slots of growing magnitude, token norms log-normal); a sink row is an
   ordinary one with 4 massive channels (fixed dims, both signs) at 1,000, 10,000 or
   30,000× its median, and a stress case of 24 such channels at 10,000×.
2. **A real forward with injected sinks**: the reference server's tiny Llama (its own
   weights and norm gains, U(0.2, 3)); massive channels added to the residual stream at
   the output of decoder layer 0 — so every aux layer, the later layers' attention and
   the final norm see them — at realistic positions: the first token (BOS) and the first
   delimiter token of each prompt. The rows are the ground truth the reference server
   dumps (aux layers, post-norm final state, bf16); the teacher's KL is the model's own
   ``lm_head`` on the final state as read back (bf16), float64 softmax, at sink and at
   ordinary rows.

Layouts: the two hsx writes (``per_token_slot``, version 3; ``per_token_slot_outliers16``,
version 4), through :mod:`hsx_async.quantize`; and, measured to decide between them and
not written by hsx, DeepSeek-style 1×128 blocks of channels with a float32 scale each
(and 1×32 blocks), the bench's own few lines below.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hsx_async.protocol import FP8, OUTLIERS, PER_TOKEN_SLOT, PER_TOKEN_SLOT_OUTLIERS16, Storage
from hsx_async.quantize import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_NORMAL,
    SCALE_MIN,
    dequantize,
    quantize,
    quantize_outliers,
)

KIMI_H, SLOTS = 7168, 4
RATIOS = (1e3, 1e4, 3e4)
MASSIVE = 4  # massive channels of a sink row (a few: 2-4 in the models studied)
STRESS = 24  # a stress case past the outliers layout's 16


@dataclass(frozen=True)
class Encoded:
    """One layout's encoding of ``x`` [..., H]: the e4m3fn codes, which entries are stored
    exactly beside them (outliers), and x̂ (float32)."""

    codes: torch.Tensor  # float32 values of q
    exact: torch.Tensor | None  # bool [..., H]
    back: torch.Tensor  # float32 [..., H]


@dataclass(frozen=True)
class Layout:
    name: str
    written_by_hsx: bool
    bytes_per_vector: Callable[[int], int]
    encode: Callable[[torch.Tensor], Encoded]


def _per_token_slot(x: torch.Tensor) -> Encoded:
    q, s = quantize(x)
    return Encoded(q.float(), None, dequantize(q, s, torch.float32))


def _outliers16(x: torch.Tensor) -> Encoded:
    q, s, index, values = quantize_outliers(x, OUTLIERS)
    back = dequantize(q, s, torch.float32, index, values)
    h = x.shape[-1]
    exact = torch.zeros((*x.shape[:-1], h + 1), dtype=torch.bool)
    exact.scatter_(-1, index.to(torch.int64).clamp_max(h), True)
    return Encoded(q.float(), exact[..., :h], back)


def _blocks(block: int) -> Callable[[torch.Tensor], Encoded]:
    """A float32 scale per block of ``block`` channels, from the block's amax, the same
    rounding otherwise (not an hsx layout: measured to compare)."""

    def encode(x: torch.Tensor) -> Encoded:
        h = x.shape[-1]
        n = -(-h // block)
        padded = x.float().new_zeros((*x.shape[:-1], n * block))
        padded[..., :h] = x.float()
        v = padded.view(*x.shape[:-1], n, block)
        lo, hi = torch.aminmax(v, dim=-1)
        s = torch.maximum(hi, lo.neg()).div_(FP8_MAX).clamp_min_(SCALE_MIN).unsqueeze(-1)
        q = (v / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
        back = (q * s).view(*x.shape[:-1], n * block)[..., :h]
        return Encoded(q.view(*x.shape[:-1], n * block)[..., :h], None, back)

    return encode


def _storage_bytes(scales: str) -> Callable[[int], int]:
    return lambda h: Storage(FP8, (0,), scales).row_bytes(1, h)


LAYOUTS = (
    Layout(PER_TOKEN_SLOT, True, _storage_bytes(PER_TOKEN_SLOT), _per_token_slot),
    Layout(PER_TOKEN_SLOT_OUTLIERS16, True, _storage_bytes(PER_TOKEN_SLOT_OUTLIERS16), _outliers16),
    Layout("blocks of 128 (not written)", False, lambda h: h + 4 * -(-h // 128), _blocks(128)),
    Layout("blocks of 32 (not written)", False, lambda h: h + 4 * -(-h // 32), _blocks(32)),
)


@dataclass
class Figures:
    """Of the non-outlier values of a set of vectors, in one layout."""

    typical: float  # median |x̂ - x| / |x|
    rel_rms: float  # mean over vectors of the relative RMS error
    subnormal: float  # share stored as subnormal or zero
    outlier_rel_max: float  # the massive channels' own largest relative error (0: none)

    def to_dict(self) -> dict[str, float]:
        return dict(vars(self))


def figures(x: torch.Tensor, enc: Encoded, massive: torch.Tensor) -> Figures:
    """``x`` [N, H] float32 (bf16 values), ``massive`` bool [N, H]: the injected channels."""
    rest = ~massive
    err = (enc.back - x).abs()
    nonzero = rest & (x != 0)
    typical = float((err[nonzero] / x.abs()[nonzero]).median())
    num = (err * rest).square().sum(-1)
    den = (x * rest).square().sum(-1).clamp_min(1e-30)
    small = (enc.codes.abs() < FP8_MIN_NORMAL) & rest
    if enc.exact is not None:
        small &= ~enc.exact
    out = float((err[massive] / x.abs()[massive]).max()) if bool(massive.any()) else 0.0
    return Figures(
        typical=typical,
        rel_rms=float((num / den).sqrt().mean()),
        subnormal=float(small.sum() / rest.sum()),
        outlier_rel_max=out,
    )


# -- 1. Kimi-shaped synthetic rows -----------------------------------------------------------


def kimi_rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, SLOTS, H] float32 (bf16 values): per-channel gains U(0.2, 3), slots of growing
    magnitude, token norms log-normal (as the writer phase's rows)."""
    gains = torch.empty(KIMI_H).uniform_(0.2, 3.0, generator=gen)
    slot_scale = torch.tensor([4.0**k for k in range(SLOTS)]).view(1, SLOTS, 1)
    token = torch.exp(torch.randn(n, 1, 1, generator=gen) * 0.5)
    x = torch.randn(n, SLOTS, KIMI_H, generator=gen) * gains * slot_scale * token
    return x.to(torch.bfloat16).float()


def with_sinks(x: torch.Tensor, dims: torch.Tensor, ratio: float) -> torch.Tensor:
    """``x`` with channels ``dims`` set to ±``ratio`` × each vector's median |value|."""
    y = x.clone()
    median = y.abs().median(dim=-1).values.unsqueeze(-1)
    sign = torch.where(torch.arange(len(dims)) % 2 == 0, 1.0, -1.0)
    y[..., dims] = ratio * median * sign
    return y.to(torch.bfloat16).float()


def synthetic_phase(args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(args.seed + 28)
    n = args.sink_rows
    base = kimi_rows(n, gen)
    dims = torch.randperm(KIMI_H, generator=gen)[:STRESS].sort().values
    cases: list[tuple[str, float, int]] = [("ordinary", 0.0, 0)]
    cases += [(f"{MASSIVE} channels at {r:,.0f}x", r, MASSIVE) for r in RATIOS]
    cases.append((f"{STRESS} channels at 10,000x", 1e4, STRESS))
    out: dict[str, Any] = {"hidden_size": KIMI_H, "slots": SLOTS, "rows": n, "cases": []}
    for label, ratio, count in cases:
        x = with_sinks(base, dims[:count], ratio) if count else base
        massive = torch.zeros(KIMI_H, dtype=torch.bool)
        massive[dims[:count]] = True
        flat, mask = x.reshape(-1, KIMI_H), massive.expand(n * SLOTS, KIMI_H)
        row: dict[str, Any] = {"case": label, "ratio": ratio, "massive": count, "layouts": {}}
        for layout in LAYOUTS:
            row["layouts"][layout.name] = figures(flat, layout.encode(flat), mask).to_dict()
        out["cases"].append(row)
        print(f"  sinks, Kimi-shaped: {label} done", flush=True)
    _ratios_to_ordinary(out["cases"])
    out["bytes"] = {
        layout.name: {
            "per_vector": layout.bytes_per_vector(KIMI_H),
            "per_token": SLOTS * layout.bytes_per_vector(KIMI_H),
            "of_bf16": SLOTS * layout.bytes_per_vector(KIMI_H) / (SLOTS * KIMI_H * 2),
            "over_per_token_slot": layout.bytes_per_vector(KIMI_H) / (KIMI_H + 4) - 1,
        }
        for layout in LAYOUTS
    }
    return out


def _ratios_to_ordinary(cases: list[dict[str, Any]]) -> None:
    """Each case's figures over the same layout's ordinary rows (the first case)."""
    ordinary = cases[0]["layouts"]
    for case in cases:
        for name, f in case["layouts"].items():
            base = ordinary[name]
            f["typical_over_ordinary"] = f["typical"] / base["typical"]
            f["rel_rms_over_ordinary"] = f["rel_rms"] / base["rel_rms"]
            f["subnormal_over_ordinary"] = f["subnormal"] / max(base["subnormal"], 1e-12)


# -- 2. a real forward with injected sinks ---------------------------------------------------


def _prompts(n: int, mean: float, vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Random prompts of the model's ids, each starting with BOS (id 0) and holding one
    delimiter token (id 3, never drawn otherwise) at a position in [4, 40)."""
    out = []
    for _ in range(n):
        t = max(48, int(torch.empty(1).exponential_(1 / mean, generator=gen)))
        ids = torch.randint(4, vocab, (t,), generator=gen)
        ids[0] = 0
        ids[int(torch.randint(4, 40, (1,), generator=gen))] = 3
        out.append(ids)
    return out


def forward_rows(
    model: Any, ids: torch.Tensor, aux: Sequence[int], dims: torch.Tensor, ratio: float
) -> torch.Tensor:
    """[T, L, H] bf16 as the reference server dumps it, with ``dims`` of the residual
    stream raised to ±``ratio`` × the row's median at the output of decoder layer 0, at the
    first token and the first delimiter (the sink positions)."""
    from hsx_async.server.reference.model import reference_hidden_states

    sinks = [0, int((ids == 3).nonzero()[0])]
    sign = torch.where(torch.arange(len(dims)) % 2 == 0, 1.0, -1.0)

    def inject(_module: Any, _args: Any, output: Any) -> Any:
        h = output[0] if isinstance(output, tuple) else output
        for p in sinks:
            h[0, p, dims] += ratio * h[0, p].abs().median() * sign
        return output

    handle = model.base_model.layers[0].register_forward_hook(inject) if ratio else None
    try:
        return reference_hidden_states(model, ids.tolist(), aux)
    finally:
        if handle is not None:
            handle.remove()


def forward_phase(args: argparse.Namespace, model: Any, aux: Sequence[int]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(args.seed + 29)
    vocab = int(model.config.vocab_size)
    h = int(model.config.hidden_size)
    prompts = _prompts(args.sink_samples, args.sink_mean_len, vocab, gen)
    dims = torch.randperm(h, generator=gen)[:MASSIVE].sort().values
    lm_head = model.get_output_embeddings()
    out: dict[str, Any] = {"hidden_size": h, "aux_layers": list(aux), "dims": dims.tolist(),
                           "samples": len(prompts), "tokens": sum(len(p) for p in prompts),
                           "cases": []}  # fmt: skip
    for ratio in (0.0, *RATIOS):
        rows = [forward_rows(model, ids, aux, dims, ratio) for ids in prompts]
        sink_at = [torch.isin(torch.arange(len(ids)), torch.tensor(
            [0, int((ids == 3).nonzero()[0])])) for ids in prompts]  # fmt: skip
        x = torch.cat(rows).float()  # [N, L, H]
        is_sink = torch.cat(sink_at)
        layouts: dict[str, Any] = {}
        row = {"ratio": ratio, "achieved": _achieved(x, is_sink, dims), "layouts": layouts}
        with torch.inference_mode():
            logp = torch.log_softmax(lm_head(x[:, -1]).double(), dim=-1)
            for layout in LAYOUTS:
                layouts[layout.name] = _layout_figures(
                    layout,
                    x=x,
                    is_sink=is_sink,
                    dims=dims,
                    ratio=ratio,
                    logp=logp,
                    lm_head=lm_head,
                )
        out["cases"].append(row)
        print(f"  sinks, tiny model forward: ratio {ratio:,.0f} done", flush=True)
    return out


def _achieved(x: torch.Tensor, is_sink: torch.Tensor, dims: torch.Tensor) -> list[float]:
    """Per slot, the median over sink rows of (largest injected |value| / row median)."""
    s = x[is_sink]
    ratio = s[..., dims].abs().amax(-1) / s.abs().median(dim=-1).values
    return [float(ratio[:, k].median()) for k in range(x.shape[1])]


def _layout_figures(
    layout: Layout,
    *,
    x: torch.Tensor,
    is_sink: torch.Tensor,
    dims: torch.Tensor,
    ratio: float,
    logp: torch.Tensor,
    lm_head: Any,
) -> dict[str, Any]:
    n, slots, h = x.shape
    enc = layout.encode(x.reshape(-1, h))
    enc_rows = Encoded(
        enc.codes.view(n, slots, h),
        None if enc.exact is None else enc.exact.view(n, slots, h),
        enc.back.view(n, slots, h),
    )
    out: dict[str, Any] = {}
    for kind, rows in (("sink", is_sink), ("ordinary", ~is_sink)):
        massive = torch.zeros(h, dtype=torch.bool)
        if kind == "sink" and ratio:
            massive[dims] = True
        part = Encoded(
            enc_rows.codes[rows].reshape(-1, h),
            None if enc_rows.exact is None else enc_rows.exact[rows].reshape(-1, h),
            enc_rows.back[rows].reshape(-1, h),
        )
        xs = x[rows].reshape(-1, h)
        out[kind] = figures(xs, part, massive.expand_as(xs)).to_dict()
        # The teacher: the model's lm_head on the final state as the reader yields it (bf16).
        final = enc_rows.back[rows][:, -1].to(torch.bfloat16).float()
        logq = torch.log_softmax(lm_head(final).double(), dim=-1)
        ref = logp[rows]
        kl = (ref.exp() * (ref - logq)).sum(-1)
        out[kind] |= {
            "rows": int(rows.sum()),
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "top1_agreement": float((ref.argmax(-1) == logq.argmax(-1)).double().mean()),
        }
    return out


# -- report ----------------------------------------------------------------------------------


def report(data: dict[str, Any], print_table: Callable[..., str]) -> list[str]:
    tables = []
    syn = data["synthetic"]
    rows = []
    for case in syn["cases"]:
        for name, f in case["layouts"].items():
            rows.append([
                case["case"], name, f"{f['typical']:.4f}", f"{f['typical_over_ordinary']:.2f}",
                f"{f['rel_rms']:.4f}", f"{f['rel_rms_over_ordinary']:.2f}",
                f"{f['subnormal']:.3%}", f"{f['outlier_rel_max']:.4f}",
            ])  # fmt: skip
    tables.append(print_table(
        f"Attention sinks, Kimi-shaped rows (H {syn['hidden_size']}, {syn['slots']} slots, "
        f"{syn['rows']} tokens): the non-outlier values of each row, FP8 alone (float32)",
        ["rows", "layout", "typical error (median)", "x ordinary", "rel RMS error",
         "x ordinary", "subnormal or zero", "massive channels' max error"],
        rows,
    ))  # fmt: skip
    tables.append(print_table(
        f"Bytes per vector at H {syn['hidden_size']} (a token: {syn['slots']} vectors)",
        ["layout", "bytes/vector", "bytes/token", "of bf16", "over per_token_slot"],
        [[name, b["per_vector"], b["per_token"], f"{b['of_bf16']:.4f}",
          f"{b['over_per_token_slot']:+.2%}"] for name, b in syn["bytes"].items()],
    ))  # fmt: skip
    fw = data["forward"]
    rows = []
    for case in fw["cases"]:
        achieved = "/".join(f"{a:,.0f}" for a in case["achieved"]) if case["ratio"] else "-"
        for name, f in case["layouts"].items():
            s, o = f["sink"], f["ordinary"]
            rows.append([
                f"{case['ratio']:,.0f}", achieved, name, f"{s['typical']:.4f}",
                f"{s['rel_rms']:.4f}", f"{s['subnormal']:.3%}", f"{o['typical']:.4f}",
                f"{o['subnormal']:.3%}", f"{s['kl_mean']:.2e}", f"{o['kl_mean']:.2e}",
                f"{o['kl_max']:.2e}", f"{o['top1_agreement']:.3f}",
            ])  # fmt: skip
    tables.append(print_table(
        f"Attention sinks injected into a real forward (the reference server's tiny Llama, H "
        f"{fw['hidden_size']}, aux {fw['aux_layers']}; {fw['samples']} prompts, "
        f"{fw['tokens']:,} tokens; channels {fw['dims']} raised at the output of layer 0 at "
        "BOS and the first delimiter): non-outlier values of sink and ordinary rows, and the "
        "teacher's KL(bf16 || FP8) in nats",
        ["injected x median", "achieved per slot (sink rows)", "layout", "sink: typical err",
         "sink: rel RMS", "sink: subnormal", "ordinary: typical err", "ordinary: subnormal",
         "KL sink rows", "KL ordinary rows (mean)", "(max)", "top-1 ordinary"],
        rows,
    ))  # fmt: skip
    return tables


def phase(args: argparse.Namespace, teacher_model: Any, aux: Sequence[int]) -> dict[str, Any]:
    syn = synthetic_phase(args)
    with torch.inference_mode():
        fw = forward_phase(args, teacher_model, aux)
    verdict = _verdict(syn, fw)
    return {"synthetic": syn, "forward": fw, "verdict": verdict}


def _verdict(syn: dict[str, Any], fw: dict[str, Any]) -> dict[str, Any]:
    """The issue's bar for the layout hsx writes by default: at every ratio (up to 16
    massive channels) the sink rows' non-outlier typical error and subnormal share within
    1.2x of an ordinary row's, and the teacher's KL at today's level."""
    name = PER_TOKEN_SLOT_OUTLIERS16
    worst: dict[str, float] = {"typical": 0.0, "rel_rms": 0.0, "subnormal_over_ordinary": 0.0}
    for case in syn["cases"][1:-1]:  # the stress case (24 channels) is past the layout
        f = case["layouts"][name]
        worst["typical"] = max(worst["typical"], f["typical_over_ordinary"])
        worst["rel_rms"] = max(worst["rel_rms"], f["rel_rms_over_ordinary"])
        worst["subnormal_over_ordinary"] = max(
            worst["subnormal_over_ordinary"], f["subnormal_over_ordinary"]
        )
    kl_today = fw["cases"][0]["layouts"][PER_TOKEN_SLOT]["ordinary"]["kl_mean"]
    kl_new = statistics.mean(
        c["layouts"][name][k]["kl_mean"] for c in fw["cases"] for k in ("sink", "ordinary")
    )
    return {
        "layout": name,
        "worst_over_ordinary": worst,
        "kl_today_per_token_slot_no_sinks": kl_today,
        "kl_outliers16_mean_of_cases": kl_new,
    }
