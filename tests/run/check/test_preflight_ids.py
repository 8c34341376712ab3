"""``hsx check`` prints the drafter-config ids for the served model's family."""

from __future__ import annotations

from pathlib import Path

import orjson

from hsx_async.run.check.preflight import Report, check_servers, draft_ids_line
from hsx_async.server.reference.model import save_default_model
from hsx_async.server.reference.server import ReferenceOptions, running_reference_server
from tests.e2e import make_config, write_samples


def _model(path: Path, arch: str, layers: int) -> dict[str, str]:
    path.mkdir()
    config = {"architectures": [arch], "num_hidden_layers": layers}
    (path / "config.json").write_bytes(orjson.dumps(config))
    return {"model_path": str(path)}


def test_ids_line_per_family(tmp_path: Path) -> None:
    llama = _model(tmp_path / "llama", "LlamaForCausalLM", 61)
    level, check, text = draft_ids_line(llama, (2, 30, 58))
    assert (level, check) == ("INFO", "draft ids")
    assert '"eagle_aux_hidden_state_layer_ids": [1, 29, 57]' in text
    deepseek = _model(tmp_path / "ds", "DeepseekV3ForCausalLM", 61)
    assert "[3, 31, 59]" in draft_ids_line(deepseek, (3, 31, 59))[2]
    # Layer 0 cannot be asked of a +1 family: said so, as a warning.
    level, _, text = draft_ids_line(llama, (0, 30, 58))
    assert level == "WARN"
    assert "no draft-config ids give layers [0, 30, 58]" in text
    level, _, text = draft_ids_line({"model_path": "org/remote"}, (2, 30, 58))
    assert level == "INFO"
    assert "hsx export with --model PATH" in text


async def test_check_prints_the_ids_of_the_served_model(tmp_path: Path, shm_root: Path) -> None:
    model = save_default_model(tmp_path / "model")
    samples = write_samples(tmp_path / "in.jsonl", 2, max_len=8, seed=0)
    options = ReferenceOptions(model=str(model), dump_root=shm_root, threads=1)
    async with running_reference_server(options) as srv:
        config = make_config(tmp_path, samples.path, [srv.url], shm_root,
                             hidden_size=srv.hidden_size, aux_layers=srv.aux_layers)  # fmt: skip
        report = Report()
        await check_servers(config, report)
    lines = {check: (level, text) for level, check, text in report.lines}
    assert lines["server"][0] == "OK"
    assert lines["draft ids"] == (
        "INFO",
        'LlamaForCausalLM: put "eagle_aux_hidden_state_layer_ids": [0, 2, 4] in the drafter\'s '
        "config so SGLang 0.5.23 captures layers [1, 3, 5] (hsx numbering: the residual "
        "stream entering layer k)",
    )
