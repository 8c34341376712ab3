"""What the tier asks ``sglang_probe.py`` (run by the SGLang environment's Python): every
family's ``set_eagle3_layers_to_capture`` on these id lists and layer counts. One probe per
session (``import sglang`` alone takes tens of seconds here), shared by the layer-rule
checks and the tiny DeepSeek-V3's draft-id check."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import orjson

from hsx_async.layer_ids import SGLANG_RULES
from tests.real_sglang import tiny_deepseek

PROBE = Path(__file__).with_name("sglang_probe.py")
PROBE_TIMEOUT = 240.0
# Multimodal classes that hand the ids to a text model: the class SGLang builds for it
# (their __init__), whose own method the probe runs behind the outer one.
INNER = {
    "KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
}
# Decoder stacks with a setter of their own, which their model class calls with the list
# it already mapped: they must store it as given (checked below), so they have no rule.
STACK_SETTERS = (
    "qwen2_moe.Qwen2MoeModel",
    "qwen3_next.Qwen3NextModel",
    "qwen3_5.Qwen3_5ForCausalLM",  # the stack of Qwen3.5 (qwen3_5_text.py holds the model)
)
_DS_AUX = list(tiny_deepseek.AUX_LAYERS)
# (ids, num_layers): the default, each rule's branches (first id 1 or not, the last layer
# reached or not), one id, a 61-layer model (DeepSeek-V3 / Kimi-K2 size), and the two id
# lists that can name the tiny DeepSeek-V3's aux layers (``hsx check`` prints one of them).
CASES: list[tuple[list[int] | None, int]] = [
    (None, 24),
    (None, 61),
    ([1, 11, 20], 24),
    ([2, 12, 21], 24),
    ([0, 5, 9], 24),
    ([4], 24),
    ([5, 10, 24], 24),
    ([1, 29, 57], 61),
    ([3, 31, 59], 61),
    ([2, 30, 58], 61),
    ([k - 1 for k in _DS_AUX], tiny_deepseek.LAYERS),
    (_DS_AUX, tiny_deepseek.LAYERS),
]


def run_probe(sglang_py: Path) -> dict[str, Any]:
    request = {
        "archs": sorted(SGLANG_RULES),
        "inner": INNER,
        "stacks": list(STACK_SETTERS),
        "cases": CASES,
    }
    done = subprocess.run(
        [str(sglang_py), str(PROBE), orjson.dumps(request).decode()],
        capture_output=True,
        timeout=PROBE_TIMEOUT,
        check=False,
    )
    out = done.stdout.decode(errors="replace")
    lines = [line for line in out.splitlines() if line.startswith("HSX-PROBE ")]
    assert done.returncode == 0 and lines, (
        f"probe failed ({done.returncode}):\n{out[-2000:]}\n{done.stderr.decode()[-4000:]}"
    )
    result: dict[str, Any] = orjson.loads(lines[-1].removeprefix("HSX-PROBE "))
    return result


def captured_by(probe: dict[str, Any], arch: str, ids: list[int], num_layers: int) -> Any:
    """What SGLang's own method of ``arch`` set for ``ids`` on ``num_layers`` layers (the
    probe must have fed it exactly those)."""
    for fed, n, got in probe["results"][arch] or []:
        if fed == ids and n == num_layers:
            return got
    raise AssertionError(f"{arch}: ids {ids} on {num_layers} layers were not probed")
