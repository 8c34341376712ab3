"""speculators 0.9.0's own trainer-side calls against ``hsx front speculators``, run in
.venv-mooncake (tests/front/test_speculators.py starts it): the OpenAI client as the trainer
calls it (``generate_hidden_states``), hs-connectors' ``MooncakeTransfer`` reading the
sample, speculators' own ``check_hidden_states``, then the trainer's delete. Unchanged code
of theirs; this script only drives it and saves what it read.

    python speculators_reader.py URL MASTER REQUESTS.json OUT.safetensors

REQUESTS.json: a list of token-id lists. OUT gets ``hidden_states_<i>`` and
``token_ids_<i>`` per sample read, and its metadata ``error_<i>`` for each that failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import openai
import torch
from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
from hs_connectors.transfer import MooncakeTransfer
from safetensors.torch import save_file
from speculators.data_generation.offline import check_hidden_states
from speculators.data_generation.vllm_client import generate_hidden_states


def connect(url: str, master: str, buffer_bytes: int) -> tuple[openai.Client, str, Any]:
    """The trainer's two clients: the OpenAI one on the front (and the model it serves),
    and hs-connectors' Mooncake transfer, set up as a reader (it hosts no segment)."""
    client = openai.Client(base_url=f"{url}/v1", api_key="unused")
    [model] = [m.id for m in client.models.list().data]
    config = MooncakeStoreConfig(
        local_hostname="127.0.0.1",
        master_server_address=master,
        global_segment_size=0,  # a reader hosts nothing
        local_buffer_size=buffer_bytes,
    )
    transfer = MooncakeTransfer(MooncakeHiddenStatesStore(config))
    transfer.setup()
    return client, model, transfer


def main(url: str, master: str, requests: str, out: str) -> int:
    client, model, transfer = connect(url, master, 16 << 20)
    tensors: dict[str, torch.Tensor] = {}
    errors: dict[str, str] = {}
    for i, ids in enumerate(json.loads(Path(requests).read_text())):
        handle, params = generate_hidden_states(client, model, {"input_ids": ids}, max_retries=0)
        try:
            got = transfer.store.get_sample(params, timeout=30.0)
            check_hidden_states(got, ids)
            tensors[f"hidden_states_{i}"] = got["hidden_states"]
            tensors[f"token_ids_{i}"] = got["token_ids"]
        except Exception as exc:  # reported to the test, which judges it
            errors[f"error_{i}"] = f"{type(exc).__name__}: {exc}"
        transfer.delete(handle)
        errors[f"gone_{i}"] = str(transfer.store._store.is_exist(handle))
    save_file(tensors, out, metadata=errors)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
