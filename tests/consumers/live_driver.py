"""Train SpecForge 0.2.0's and speculators 0.9.0's EAGLE-3 drafters on samples ``hsx run``
is still extracting; print one JSON report.

Run by tests/consumers/test_live_training.py in the consumers venv. Each trainer is a
registered consumer of the live dataset (``hsx_async.dataset.live.LiveDataset``, its
``view`` the trainer's layout: the export formats' own samples, the final state converted
as the exports convert it) and runs its own training step on each sample, one sample per
step, acknowledging it once the optimizer step is done:

- SpecForge: the sample as ``load_feature_file`` hands it → ``build_offline_normalizer``
  → ``build_offline_collator`` → ``TrainBatch`` → ``Eagle3TrainStrategy.forward_loss`` of an
  ``OnlineEagle3Model`` over a 1-layer ``LlamaForCausalLMEagle3`` (its ``TargetHead`` the
  teacher) → backward → AdamW step. Its loss is a Triton kernel (``core/loss.py``), which
  cannot run on a CPU: the stand-in is SpecForge's own reference, ``_compute_loss``, run
  uncompiled (the same formula: ``-(mask · target_p · log_softmax(logits)).sum(-1).mean()``),
  and ``triton`` is stood in only while that module is imported (torch never sees it);
- speculators: the sample as hs-connectors' ``FileTransfer`` hands it, through
  ``ArrowDataset._get_raw_data`` and ``BaseDataset.__getitem__`` (their own code, called
  on a stand-in ``self`` holding the live sample) → ``CollateFn`` →
  ``Eagle3DraftModel.forward`` (its loss) → backward → AdamW step.

For each step: the loss, how far the draft's weights moved, the teacher's logits against
the target model's own (as tests/consumers/trainer_driver.py computes them), and whether
extraction was complete when the step ran (hsx's logs, read as the live reader reads them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hsx_async.dataset.live.dataset import HSX_ID, LiveDataset
from hsx_async.dataset.live.follow import DatasetFollower

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.consumers.trainer_driver import hf_logits, logit_error, speculators_teacher


def import_specforge_loss() -> Any:
    """SpecForge's loss module, its ``import triton`` answered by a stand-in only while it
    is imported (torch's own modules are imported first, so they find no triton)."""
    torch.compile(lambda x: x)  # torch imports what it needs (and looks for triton) now

    def anything(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return object()

    triton = types.ModuleType("triton")
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)  # type: ignore[attr-defined]
    triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()  # type: ignore[attr-defined]
    language = types.ModuleType("triton.language")
    language.__getattr__ = anything  # type: ignore[method-assign]
    triton.language = language  # type: ignore[attr-defined]
    sys.modules["triton"], sys.modules["triton.language"] = triton, language
    try:
        from specforge.core import loss
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]
    return loss


class ReferenceLoss:
    """``LogSoftmaxLoss.apply`` as SpecForge's reference computes it (autograd by torch)."""

    reference: Any = None

    @classmethod
    def apply(cls, logits: torch.Tensor, target_p: torch.Tensor, mask: torch.Tensor) -> Any:
        return cls.reference(logits, target_p, mask)


def draft_config(path: Path, target: Any) -> Path:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_act": "silu", "hidden_size": target.hidden_size,
        "intermediate_size": 2 * target.hidden_size, "max_position_embeddings": 2048,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32",
        "vocab_size": target.vocab_size, "draft_vocab_size": target.vocab_size,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }  # fmt: skip
    path.write_text(json.dumps(config))
    return path


def moved(params: list[torch.Tensor], before: list[torch.Tensor]) -> float:
    return float(sum((p.detach() - b).norm() for p, b in zip(params, before, strict=True)))


class SpecForgeTrainer:
    def __init__(self, model_dir: Path, work: Path, target: Any) -> None:
        loss = import_specforge_loss()
        ReferenceLoss.reference = loss._compute_loss._torchdynamo_orig_callable
        import specforge.algorithms.eagle3.model as eagle3
        from specforge.algorithms.eagle3.data import (
            build_offline_collator,
            build_offline_normalizer,
        )
        from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
        from specforge.modeling.target.target_head import TargetHead
        from specforge.runtime.contracts import TrainBatch
        from specforge.training.strategies.base import Eagle3TrainStrategy, _prepare_eagle_target

        eagle3.LogSoftmaxLoss = ReferenceLoss  # the CPU stand-in for the Triton kernel
        config = AutoDraftModelConfig.from_file(str(draft_config(work / "draft.json", target)))
        draft = AutoDraftModel.from_config(
            config, attention_backend="sdpa", torch_dtype=torch.float32
        )
        vocab = target.vocab_size
        draft.t2d.copy_(torch.ones(vocab, dtype=torch.bool))
        draft.d2t.copy_(torch.zeros(vocab, dtype=torch.int64))
        self.head = TargetHead.from_pretrained(str(model_dir))
        self.model = eagle3.OnlineEagle3Model(draft_model=draft, length=3, attention_backend="sdpa")
        self.strategy = Eagle3TrainStrategy(self.model, target_head=self.head)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3)
        self.normalize = build_offline_normalizer(4096)
        self.collate = build_offline_collator()
        self.train_batch = TrainBatch
        self.prepare = _prepare_eagle_target

    def step(self, sample: dict[str, Any], hf: Any) -> dict[str, Any]:
        raw = {k: v for k, v in sample.items() if k != HSX_ID}
        batch = self.collate([self.normalize(raw)])
        # SpecForge's files and this view hold bfloat16 states; its GPU training runs the
        # draft in bfloat16. Here the draft is float32 (CPU): the aux states it projects go
        # up, exactly; "target" stays bfloat16 for the teacher's head (loaded as bfloat16).
        batch = {k: v.float() if k != "target" and torch.is_tensor(v) and v.is_floating_point()
                 else v for k, v in batch.items()}  # fmt: skip
        tb = self.train_batch(sample_ids=[sample[HSX_ID]], strategy="eagle3", tensors=batch,
                              metadata={"target_repr": "hidden_state"})  # fmt: skip
        before = [p.detach().clone() for p in self.params]
        out = self.strategy.forward_loss(tb)
        self.optimizer.zero_grad()
        out.loss.backward()
        self.optimizer.step()
        with torch.inference_mode():
            _ids, teacher, _ = self.prepare(
                target_head=self.head, target_repr="hidden_state", input_ids=batch["input_ids"],
                target=batch["target"], loss_mask=batch["loss_mask"], device=torch.device("cpu"),
            )  # fmt: skip
        want = hf_logits(hf, batch["input_ids"][0])[1:]
        return {"loss": float(out.loss), "moved": moved(self.params, before),
                "teacher": logit_error(teacher[0, :-1], want)}  # fmt: skip


class SpeculatorsTrainer:
    def __init__(self, model_dir: Path, aux: list[int], target: Any) -> None:
        from speculators.losses import resolve_loss_config
        from speculators.train.data import ArrowDataset, BaseDataset, CollateFn

        self.model = speculators_teacher(model_dir, aux, target.vocab_size, attn="eager").train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3)
        self.raw_data, self.item, self.collate_cls = (
            ArrowDataset._get_raw_data, BaseDataset.__getitem__, CollateFn
        )  # fmt: skip
        self.hidden, self.layers = target.hidden_size, len(aux)
        # speculators' own eager loss (its --loss-implementation eager): the fused default
        # is a Triton kernel, which the CPU has not; kl_div is its default for EAGLE-3.
        self.loss_config = resolve_loss_config("kl_div", "eager")

    def _item(self, sample: dict[str, Any]) -> Any:
        """speculators' own item from the live sample: ``ArrowDataset._get_raw_data`` (its
        transfer hands the hs file's tensors, its rows the ids and mask) then
        ``BaseDataset.__getitem__``."""
        stored = {"hidden_states": sample["hidden_states"], "token_ids": sample["token_ids"]}
        transfer = types.SimpleNamespace(get_cached=lambda _i: stored)
        rows = [{"input_ids": sample["token_ids"], "loss_mask": sample["loss_mask"]}]
        arrow = types.SimpleNamespace(transfer=transfer, data=rows, on_missing="raise",
                                      _map_to_file_idx=lambda i: i)  # fmt: skip
        raw = self.raw_data(arrow, 0)
        base = types.SimpleNamespace(_get_raw_data=lambda _i: raw, transform=None)
        return self.item(base, 0)

    def step(self, sample: dict[str, Any], hf: Any) -> dict[str, Any]:
        item = self._item(sample)
        t = int(item["input_ids"].shape[0])
        batch = self.collate_cls(t, self.hidden, num_target_layers=self.layers)([item])
        # The view's states are bfloat16 (as speculators' files); the drafter here is float32
        # (CPU): they go up, exactly.
        tensors = {k: v.float() if v.is_floating_point() else v
                   for k, v in batch.items() if isinstance(v, torch.Tensor)}  # fmt: skip
        before = [p.detach().clone() for p in self.params]
        _draft, loss, _metrics = self.model(**tensors, ttt_steps=1, loss_config=self.loss_config)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        with torch.inference_mode():
            last = tensors["verifier_last_hidden_states"]
            logits = self.model.verifier_lm_head(self.model.verifier_norm(last))[0]
        want = hf_logits(hf, item["input_ids"])
        return {"loss": float(loss), "moved": moved(self.params, before),
                "teacher": logit_error(logits, want)}  # fmt: skip


def main() -> int:
    """The report is the one JSON document on stdout; what the trainers print goes to
    stderr (speculators prints to stdout)."""
    report_to = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        report = _train()
    json.dump(report, report_to)
    return 0


def _train() -> dict[str, list[dict[str, Any]]]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--aux-layers", required=True)
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    aux = [int(x) for x in args.aux_layers.split(",")]
    target = AutoConfig.from_pretrained(str(args.model))
    hf: Any = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    hf.eval()
    trainers: dict[str, SpecForgeTrainer | SpeculatorsTrainer] = {
        "specforge": SpecForgeTrainer(args.model, args.work, target),
        "speculators": SpeculatorsTrainer(args.model, aux, target),
    }
    live = {
        name: LiveDataset(
            args.out,
            consumer=name,
            view=name,
            model=args.model,
            prefetch=1,
            poll_interval=0.05,
            wait_timeout=120,
        )
        for name in trainers
    }
    streams = {name: iter(data) for name, data in live.items()}
    follower = DatasetFollower(args.out)
    report: dict[str, list[dict[str, Any]]] = {name: [] for name in trainers}
    while streams:
        for name in list(streams):  # one step of each trainer in turn
            sample = next(streams[name], None)
            if sample is None:
                del streams[name]
                continue
            seen = follower.refresh()
            step = trainers[name].step(sample, hf)
            live[name].done(sample)
            live[name].ack()  # the optimizer step is done: never delivered again
            report[name].append({"id": sample[HSX_ID], "committed": len(seen.order),
                                 "complete": seen.complete, **step})  # fmt: skip
    return report


if __name__ == "__main__":
    sys.exit(main())
