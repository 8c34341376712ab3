"""speculators' trainer side, pulling samples through ``hsx front speculators`` as fast as
it can: ``--threads`` workers (as its dataloader workers do), each asking the front for a
sample with speculators' own call and reading it with hs-connectors' ``MooncakeTransfer``,
then deleting it, as the trainer does. Run in .venv-mooncake by ``bench/front.py``.

    python bench/front_reader.py URL MASTER PROMPTS.json THREADS

Prints one JSON line: samples read, failures, bytes of tensors read, wall seconds from the
first request to the last sample read.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from speculators.data_generation.vllm_client import generate_hidden_states

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.front.speculators_reader import connect


def main(url: str, master: str, prompts_file: str, threads: str) -> int:
    prompts = json.loads(Path(prompts_file).read_text())
    client, model, transfer = connect(url, master, 64 << 20)
    lock = threading.Lock()
    todo = list(enumerate(prompts))
    totals = {"samples": 0, "failed": 0, "bytes": 0}

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                _, ids = todo.pop()
            handle, params = generate_hidden_states(client, model, {"input_ids": ids})
            try:
                got = transfer.store.get_sample(params, timeout=120.0)
                nbytes = sum(t.numel() * t.element_size() for t in got.values())
                with lock:
                    totals["samples"] += 1
                    totals["bytes"] += nbytes
            except Exception:  # noqa: BLE001 - counted; the bench reports it
                with lock:
                    totals["failed"] += 1
            transfer.delete(handle)

    started = time.monotonic()
    workers = [threading.Thread(target=work) for _ in range(int(threads))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps({**totals, "wall_s": time.monotonic() - started}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
