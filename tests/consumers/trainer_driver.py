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
  exported before it converted the final state).
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
            }
        )
    return out


def speculators_teacher(model_dir: Path, aux: list[int], vocab: int) -> Any:
    from speculators.models.eagle3.core import Eagle3DraftModel

    config = AutoConfig.from_pretrained(str(model_dir))
    return Eagle3DraftModel.from_training_args(
        config,
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--specforge", type=Path, required=True)
    parser.add_argument("--speculators", type=Path, required=True)
    parser.add_argument("--aux-layers", required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the trainers' deprecation chatter is not the result
    aux = [int(x) for x in args.aux_layers.split(",")]
    model: Any = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    model.eval()
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
