"""SpecForge 0.2.0's own online producer and consumer, as its disaggregated job runs them
(``specforge/training/disaggregated.py``, ``_build_online``), pointed at ``hsx front
specforge``: run in .venv-mooncake by tests/front/test_specforge.py.

Usage: specforge_client.py FRONT_URL MASTER PLAN_JSON OUT_SAFETENSORS

PLAN_JSON: ``{store_id, run_id, aux_layer_ids, hidden_size, client_segment_mib (0 by
default, as SpecForge's launcher), tasks: [{input_ids, loss_mask, attempt}]}``. The
producer (a ``MooncakeFeatureStore`` and the EAGLE-3 streaming layout's
``SGLangServerCaptureAdapter``, its request code unchanged) captures every task in one
``produce_refs`` lease batch and publishes the good refs on a ``StreamingRefChannel``; the
consumer (its own ``MooncakeFeatureStore`` client, ``retain_on_release`` as in the
consumer role) polls the channel and reads each sample through SpecForge's own
``FeatureDataLoader`` (get, clone, release, stacked in batches of one); then the producer
aborts the acknowledged samples as its ack controller does. Written to OUT: each read
feature as ``{name}_{i}``; metadata ``error_{i}`` (a failure's reason), ``retryable_{i}``,
``gone_{i}`` ("1" once every key of the task is absent from Mooncake), ``consumed``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from safetensors.torch import save_file
from specforge.algorithms.eagle3.providers import create_registration
from specforge.inference.adapters.server_capture import (
    ServerCaptureFailure,
    ServerCaptureSchema,
    SGLangServerCaptureAdapter,
)
from specforge.inference.capture import CaptureConfig
from specforge.runtime.contracts import PromptTask
from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore
from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

BUFFER = 256 << 20  # its client_buffer_size default


def _store(master: str, store_id: str, *, retain: bool, segment: int) -> MooncakeFeatureStore:
    return MooncakeFeatureStore(
        store_id=store_id,
        setup_kwargs={
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "master_server_addr": master,
            "global_segment_size": segment,
            "local_buffer_size": BUFFER,
        },
        retain_on_release=retain,
    )


def main() -> int:
    url, master, plan_path, out = sys.argv[1:5]
    plan = json.loads(Path(plan_path).read_text())
    registration = create_registration()
    streaming = registration.providers.server_streaming_for("text")
    layout = streaming.layout
    schema = ServerCaptureSchema(
        aux_feature=layout.aux_feature,
        last_hidden_feature=layout.last_hidden_feature,
        passthrough=layout.passthrough,
        attention_mask_feature=layout.attention_mask_feature,
    )
    [contract] = [c for c in registration.spec.feature_contracts if c.mode.value == "streaming"]
    capture = CaptureConfig.from_strategy(
        contract.required_tensors,
        plan["aux_layer_ids"],
        target_repr=streaming.target_representation,
        target_hidden_size=plan["hidden_size"],
    )
    # Online capture is server-owned: SpecForge's launcher gives both roles' clients no
    # segment (DisaggregatedDeploymentConfig); a plan may give them one, as a hand-made job.
    segment = plan.get("client_segment_mib", 0) << 20
    producer = _store(master, plan["store_id"], retain=False, segment=segment)
    consumer = _store(master, plan["store_id"], retain=True, segment=segment)
    adapter = SGLangServerCaptureAdapter(
        url,
        producer,
        run_id=plan["run_id"],
        algorithm=registration.name,
        schema=schema,
        timeout_s=120.0,
    )
    tasks = [
        PromptTask(
            task_id=f"t{i}",
            run_id=plan["run_id"],
            source_id=f"s{i}",
            payload={"input_ids": t["input_ids"], "loss_mask": t["loss_mask"]},
            max_length=len(t["input_ids"]),
            attempt=t.get("attempt", 0),
        )
        for i, t in enumerate(plan["tasks"])
    ]
    results = adapter.produce_refs(tasks, capture=capture)
    notes: dict[str, str] = {}
    keys: dict[int, list[str]] = {}
    refs = []
    for i, result in enumerate(results):
        if isinstance(result, ServerCaptureFailure):
            notes[f"error_{i}"] = result.reason
            notes[f"retryable_{i}"] = str(result.retryable)
            sample_id = f"{plan['run_id']}:{tasks[i].task_id}"
            names = ["hidden_state", "target", "input_ids", "loss_mask", "attention_mask"]
            keys[i] = [f"{plan['store_id']}/{sample_id}/g1/{n}" for n in names]
            continue
        refs.append(result)
        gen = result.metadata["generation"]
        keys[i] = [f"{plan['store_id']}/{result.sample_id}/g{gen}/{n}" for n in result.feature_keys]

    tensors = {}
    with tempfile.TemporaryDirectory() as tmp:
        channel_path = str(Path(tmp) / "refs.jsonl")
        channel = StreamingRefChannel(channel_path)
        channel.publish_batch(refs)
        channel.close()
        reader = StreamingRefChannel(channel_path)
        polled = reader.poll()
        task_of = {ref.sample_id: int(ref.source_task_id.removeprefix("t")) for ref in polled}
        # SpecForge's own loader (refs mode, as its trainer's offline/streamed epochs):
        # get, clone, release; batches of one, stacked (dim 0 is the batch).
        loader = FeatureDataLoader(
            consumer, refs=polled, batch_size=1, drop_last=False, gc_interval_s=None
        )
        for batch in loader:
            [sample_id] = batch.sample_ids
            i = task_of[sample_id]
            tensors.update({f"{name}_{i}": t[0] for name, t in batch.tensors.items()})
        reader.mark_consumed(len(polled))
        notes["consumed"] = str(reader.consumed_remote())
    for ref in refs:  # the producer frees what the consumer acknowledged
        producer.abort(ref.sample_id, reason="acked")
    producer.drain_pending_removals(max_attempts=40, retry_interval_s=0.25)
    for i, task_keys in keys.items():
        notes[f"gone_{i}"] = str(int(not any(producer._store.is_exist(k) == 1 for k in task_keys)))
    save_file({k: v.contiguous() for k, v in tensors.items()}, out, metadata=notes)
    producer._store.close()
    consumer._store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
