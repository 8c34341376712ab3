"""Load hsx exports through SpecForge 0.2.0's and speculators 0.9.0's own code; print JSON.

Run by tests/consumers in the consumers venv (``bash .ci/consumers-env``), where those
packages are importable; the test process itself never imports them. For every sample it
reports what each trainer's loader produced (shapes, dtypes, ids, loss mask) and how far the
trainer's teacher logits are from the target model's own (a Hugging Face forward of the
same directory):

- SpecForge: ``build_offline_reader`` → ``load_feature_file`` → ``normalize_offline_sample``
  → ``DataCollatorWithPadding``, teacher ``TargetHead.from_pretrained`` applied by the
  training step's ``_prepare_eagle_target`` (its one-token shift, then the LM head on the
  ``target`` tensor, which is the post-norm state); its loss (``core/loss.py``) is a Triton
  kernel and is not run;
- speculators: ``ArrowDataset`` (``load_from_disk`` + ``FileTransfer``) → ``CollateFn``,
  teacher ``Eagle3DraftModel.from_training_args`` (``verifier_lm_head(verifier_norm(x))``
  on ``verifier_last_hidden_states``, the forward's target computation), and the draft
  vocabulary built from ``token_freq.pt`` by ``build_vocab_mappings_from_distribution``;
- the trap: the stored post-norm state fed to speculators' teacher unchanged (what hsx
  exported before it converted the final state);
- FP8 (``--fp8-*``): SpecForge's loader on the export of an FP8 dataset (bf16, its target
  also compared with the model's post-norm state), and speculators' ``ArrowDataset`` with
  hs-connectors' ``FP8Transfer`` (what ``--hidden-states-backend fp8`` builds) on an FP8
  export: the files as stored (``FileTransfer``), what it yields against hsx's own
  ``HiddenStateDataset`` over the source dataset, against the model's own hidden states
  (aux layers, and the pre-norm final state: the final norm's input), and the teacher;
  and (``--outliers-*``) the bfloat16 export of an FP8 dataset of the outliers layout,
  which FP8Transfer cannot read, through the plain ``FileTransfer`` the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def logit_error(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    got, want = got.float(), want.float()
    return {
        "rel": float((got - want).norm() / want.norm()),
        "agree": int((got.argmax(-1) == want.argmax(-1)).sum()),
        "tokens": int(want.shape[0]),
    }


def hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = model(input_ids=ids[None]).logits[0]
    return logits


def model_states(model: Any, ids: torch.Tensor, aux: list[int]) -> dict[str, torch.Tensor]:
    """The model's own float32 states: aux layers ``[T, k·H]`` (Hugging Face
    hidden_states[k]), the final norm's input (pre-norm) and output (post-norm) ``[T, H]``."""
    captured: list[torch.Tensor] = []
    norm = model.base_model.norm
    hook = norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0][0].clone()))
    try:
        with torch.inference_mode():
            out = model.base_model(input_ids=ids[None], use_cache=False, output_hidden_states=True)
    finally:
        hook.remove()
    states = {"pre": captured[-1], "post": out.last_hidden_state[0]}
    if aux:
        states["aux"] = torch.cat([out.hidden_states[k][0] for k in aux], dim=-1)
    return states


def row_error(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """Relative RMS error of each row (token) of ``got`` against ``want``: mean and max."""
    got, want = got.float(), want.float()
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    return {"mean": float(rel.mean()), "max": float(rel.max())}


def max_rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest elementwise ``|got - want| / |want|`` (over nonzero ``want``)."""
    got, want = got.float(), want.float()
    nonzero = want != 0
    if bool((got[~nonzero] != 0).any()):
        return float("inf")
    return float(((got - want).abs()[nonzero] / want.abs()[nonzero]).max())


def specforge_report(root: Path, model_dir: Path, model: Any) -> list[dict[str, Any]]:
    from specforge.algorithms.eagle3.data import (
        build_offline_collator,
        build_offline_normalizer,
        build_offline_reader,
    )
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.training.strategies.base import _prepare_eagle_target

    refs = build_offline_reader(str(root), run_id="hsx", ttt_length=7, max_len=4096).read()
    normalize = build_offline_normalizer(4096)
    collate = build_offline_collator()
    head = TargetHead.from_pretrained(str(model_dir))
    out = []
    for ref in refs:
        raw = load_feature_file(ref.feature_store_uri.removeprefix("file://"))
        item = normalize(raw)
        batch = collate([item])
        ids = batch["input_ids"][0]
        with torch.inference_mode():
            # The training step's own teacher: TargetHead's shift, then its LM head.
            shifted_ids, teacher, _ = _prepare_eagle_target(
                target_head=head,
                target_repr="hidden_state",
                input_ids=batch["input_ids"],
                target=batch["target"],
                loss_mask=batch["loss_mask"],
                device=torch.device("cpu"),
            )
        # Position i is taught the distribution after token i + 1 (SpecForge shifts itself).
        want = hf_logits(model, ids)[1:]
        out.append(
            {
                "file": ref.feature_store_uri,
                "input_ids": ids.tolist(),
                "shifted_ids": shifted_ids[0].tolist(),
                "loss_mask": batch["loss_mask"][0].flatten().tolist(),
                "raw_loss_mask": raw["loss_mask"].tolist(),
                "hidden_state_shape": list(batch["hidden_state"].shape),
                "target_shape": list(batch["target"].shape),
                "dtypes": [str(batch["hidden_state"].dtype), str(batch["target"].dtype)],
                "teacher": logit_error(teacher[0, :-1], want),
                "target_vs_model": row_error(
                    batch["target"][0], model_states(model, ids, [])["post"]
                ),
            }
        )
    return out


def speculators_teacher(
    model_dir: Path, aux: list[int], vocab: int, *, attn: str | None = None
) -> Any:
    """speculators' EAGLE-3 drafter over the model; ``attn``: its ``draft_attn_impl``
    (default FlexAttention, which has no backward on the CPU: a training step here takes
    speculators' own ``"eager"``)."""
    from speculators.models.eagle3.core import Eagle3DraftModel

    config = AutoConfig.from_pretrained(str(model_dir))
    return Eagle3DraftModel.from_training_args(
        config,
        **({"draft_attn_impl": attn} if attn else {}),
        draft_vocab_size=vocab,
        norm_before_residual=False,
        ttt_steps=1,
        verifier_name_or_path=str(model_dir),
        target_layer_ids=aux,
        num_layers=1,
    ).eval()


def speculators_report(
    root: Path, model_dir: Path, model: Any, aux: list[int], post_norm: list[torch.Tensor]
) -> dict[str, Any]:
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    config = AutoConfig.from_pretrained(str(model_dir))
    data = ArrowDataset(max_len=4096, datapath=str(root), on_missing="raise")
    teacher = speculators_teacher(model_dir, aux, config.vocab_size)
    samples = []
    for index in range(len(data)):
        item = data[index]
        t = int(item["input_ids"].shape[0])
        batch = CollateFn(t, config.hidden_size, num_target_layers=len(aux))([item])
        last = batch["verifier_last_hidden_states"]
        with torch.inference_mode():
            logits = teacher.verifier_lm_head(teacher.verifier_norm(last))[0]
            trap = teacher.verifier_lm_head(teacher.verifier_norm(post_norm[index][None]))[0]
        want = hf_logits(model, item["input_ids"])
        samples.append(
            {
                "input_ids": item["input_ids"].tolist(),
                "loss_mask": item["loss_mask"].tolist(),
                "hidden_states_shape": list(batch["hidden_states"].shape),
                "last_shape": list(last.shape),
                "dtypes": [str(batch["hidden_states"].dtype), str(last.dtype)],
                "teacher": logit_error(logits, want),
                "trap": logit_error(trap, want),
            }
        )
    freq = torch.load(root / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, 64, config.vocab_size)
    top = sorted(freq, key=lambda tok: (-freq[tok], tok))[:64]
    return {
        "samples": samples,
        "draft_vocab": {
            "d2t_shape": list(d2t.shape),
            "t2d_true": int(t2d.sum()),
            "top_tokens_kept": bool(t2d[top].all()),
        },
    }


def fp8_speculators_report(
    root: Path,
    source: Path,
    model_dir: Path,
    model: Any,
    aux: list[int],
    *,
    converted: bool = False,
    fp8: bool = True,
) -> list[dict[str, Any]]:
    """speculators' ArrowDataset with FP8Transfer on an FP8 export of ``source`` (``fp8``
    False: its default FileTransfer, on a bfloat16 export of an FP8 dataset).
    ``converted``: ``source`` holds the post-norm final state, which the export turned into
    speculators' pre-norm one (``post / w``, quantized once more): the final state is then
    compared through the teacher's norm with the model's post-norm state, and with hsx's
    (post-norm) Dataset the same way."""
    from hs_connectors import FileTransfer, FP8Transfer
    from speculators.train.data import ArrowDataset, CollateFn

    from hsx_async.dataset import HiddenStateDataset

    config = AutoConfig.from_pretrained(str(model_dir))
    transfer = FP8Transfer(root / "hidden_states") if fp8 else None
    data = ArrowDataset(max_len=4096, datapath=str(root), on_missing="raise",
                        **({"transfer": transfer} if transfer else {}))  # fmt: skip
    plain = FileTransfer(root / "hidden_states")
    ours = HiddenStateDataset(source)
    by_id = {str(sample_id): i for i, sample_id in enumerate(ours.ids)}
    hsx_ids = [json.loads(r)["hsx_id"] for r in (root / "samples.jsonl").read_text().splitlines()]
    teacher = speculators_teacher(model_dir, aux, config.vocab_size)
    out = []
    for index in range(len(data)):
        item = data[index]
        stored = plain.get_cached(index)
        assert stored is not None
        batch = CollateFn(int(item["input_ids"].shape[0]), config.hidden_size,
                          num_target_layers=len(aux))([item])  # fmt: skip
        mine = ours[by_id[hsx_ids[index]]]
        states = model_states(model, item["input_ids"], aux)
        last = batch["verifier_last_hidden_states"]
        with torch.inference_mode():
            normed = teacher.verifier_norm(last)
            logits = teacher.verifier_lm_head(normed)[0]
        if converted:  # speculators' norm of the pre-norm state is the post-norm one
            got_last, hsx_last, model_last = normed[0], mine["hidden_states"], states["post"]
        else:
            got_last = item["verifier_last_hidden_states"]
            hsx_last, model_last = mine["hidden_states"], states["pre"]
        out.append(
            {
                "input_ids": item["input_ids"].tolist(),
                "stored": {k: [str(v.dtype), list(v.shape)] for k, v in sorted(stored.items())},
                "dtypes": [str(item["hidden_states"].dtype), str(last.dtype)],
                "vs_hsx": {
                    "aux": max_rel_diff(item["hidden_states"], mine["aux_hidden_states"]),
                    "aux_rows": row_error(item["hidden_states"], mine["aux_hidden_states"]),
                    "last": max_rel_diff(got_last, hsx_last),
                    "last_rows": row_error(got_last, hsx_last),
                    "loss_mask_equal": bool(
                        torch.equal(item["loss_mask"], mine["loss_mask"].long())
                    ),
                },
                "vs_model": {
                    "aux": row_error(item["hidden_states"], states["aux"]),
                    "last": row_error(got_last, model_last),
                },
                "teacher": logit_error(logits, hf_logits(model, item["input_ids"])),
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--specforge", type=Path)
    parser.add_argument("--speculators", type=Path)
    parser.add_argument("--aux-layers", required=True)
    parser.add_argument("--fp8-specforge", type=Path, help="SpecForge export of an FP8 dataset")
    parser.add_argument("--fp8-speculators", type=Path, help="FP8 speculators export")
    parser.add_argument("--fp8-source", type=Path, help="the hsx dataset it was exported from")
    parser.add_argument(
        "--fp8-speculators-post",
        type=Path,
        help="FP8 speculators export (--dtype float8_e4m3fn) of a post-norm one",
    )
    parser.add_argument("--fp8-post-source", type=Path, help="the post-norm dataset of it")
    parser.add_argument(
        "--outliers-speculators", type=Path, help="bf16 export of an outliers-layout dataset"
    )
    parser.add_argument("--outliers-source", type=Path, help="the hsx dataset of it")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the trainers' deprecation chatter is not the result
    aux = [int(x) for x in args.aux_layers.split(",")]
    model: Any = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    model.eval()
    if args.fp8_specforge is not None:
        report = {
            "specforge": specforge_report(args.fp8_specforge, args.model, model),
            "speculators": fp8_speculators_report(
                args.fp8_speculators, args.fp8_source, args.model, model, aux
            ),
            "speculators_post": fp8_speculators_report(
                args.fp8_speculators_post,
                args.fp8_post_source,
                args.model,
                model,
                aux,
                converted=True,
            ),
        }
        if args.outliers_speculators is not None:
            report["speculators_outliers"] = fp8_speculators_report(
                args.outliers_speculators, args.outliers_source, args.model, model, aux, fp8=False
            )
        json.dump(report, sys.stdout)
        return 0
    sf = specforge_report(args.specforge, args.model, model)
    # The post-norm state as hsx stores it (= SpecForge's target), in speculators' order.
    by_ids = {
        tuple(torch.load(p, weights_only=True)["input_ids"].tolist()): p
        for p in args.specforge.rglob("*.ckpt")
    }
    post = []
    for row in (args.speculators / "samples.jsonl").read_text().splitlines():
        ids = tuple(json.loads(row)["input_ids"])
        post.append(torch.load(by_ids[ids], weights_only=True)["hidden_state"][0])
    spec = speculators_report(args.speculators, args.model, model, aux, post)
    json.dump({"specforge": sf, "speculators": spec}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
