"""Run by ``test_readme_path.py`` in the directory the README's conversations path made
(inside the test's private namespaces, where only this process can see it): what each
command wrote. ``argv[1]``: the clone. Prints ``CHECKED`` when every check holds."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import torch

from hsx_async.dataset.manifest import read_manifest


def main(repo: Path, here: Path) -> None:
    source = (repo / "deploy" / "examples" / "tiny-conversations.jsonl").read_bytes().splitlines()
    regen = [orjson.loads(x) for x in (here / "regen.jsonl").read_bytes().splitlines()]
    regen_q = (here / "regen.quarantine.jsonl").read_bytes().splitlines()
    assert len(regen) + len(regen_q) == len(source) and len(regen_q) == 2, (regen, regen_q)
    lines = (here / "samples.jsonl").read_bytes().splitlines()
    samples = {s["id"]: s for s in map(orjson.loads, lines)}
    assert set(samples) == {r["id"] for r in regen}
    summary = orjson.loads((here / "samples.summary.json").read_bytes())
    assert summary["samples"] == len(samples) and "extraction_estimate" in summary
    assert {e.id for e in read_manifest(here / "hsx-out")} == set(samples)
    # The exported training files carry each sample's ids and mask unchanged.
    exported = list((here / "specforge-data").rglob("*.ckpt"))
    assert len(exported) == len(samples)
    seen = set()
    for path in exported:
        data = torch.load(path, weights_only=True)
        ids = data["input_ids"].flatten().tolist()
        match = [s for s in samples.values() if s["input_ids"] == ids]
        assert match, f"{path} holds no prepared sample"
        assert data["loss_mask"].flatten().tolist() == match[0]["loss_mask"]
        seen.add(match[0]["id"])
    assert seen == set(samples)
    print("CHECKED", len(samples))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path.cwd())
