"""The README's commands for speculators' online job through ``hsx front`` cannot drift
from the code: the ``hsx front`` line parses with hsx's own parser, every option of the
``speculators train`` line is one speculators 0.9.0's trainer takes (its own ``--help``,
in .venv-mooncake), and the layer ids agree across the server, hsx and the trainer."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import pytest

from hsx_async.cli import build_parser
from hsx_async.layer_ids import draft_ids
from tests.front.conftest import REPO, mooncake_python

HEADING = "### speculators' own online trainer, through Mooncake (`hsx front speculators`)"


def _blocks() -> list[str]:
    text = (REPO / "README.md").read_text()
    at = text.index(f"\n{HEADING}\n")
    end = text.index("\n#", at + 1)
    return re.findall(r"```text\n(.*?)```", text[at:end], re.S)


def _commands(block: str) -> list[list[str]]:
    """Each command of a block, continuation lines joined, comments and ``&`` dropped."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        out.append([w for w in words if w != "&"])
    return [c for c in out if c]


def test_the_hsx_front_line_parses_and_names_the_layers_the_server_captures() -> None:
    serve, train = _blocks()
    commands = _commands(serve)
    [front] = [c for c in commands if c[:3] == ["hsx", "front", "speculators"]]
    args = build_parser().parse_args(front[1:])
    assert args.handler == "hsx_async.cli.handlers.front:front_command"
    assert args.mooncake_master == "MASTER:50051" and args.listen == "0.0.0.0:8000"
    [launch] = [c for c in commands if any(w.endswith("launch.sh") for w in c)]
    layers = next(w for w in launch if w.startswith("HSX_AUX_LAYERS=")).split("=")[1]
    [trainer] = _commands(train)
    at = trainer.index("--target-layer-ids")
    assert trainer[at + 1 : at + 4] == layers.split(","), "the trainer's ids are hsx's"
    assert f"http://FRONT_NODE:{args.listen.split(':')[1]}/v1" in trainer


@pytest.mark.mooncake
def test_every_speculators_train_option_is_one_the_trainer_takes() -> None:
    [trainer] = _commands(_blocks()[1])
    assert trainer[:2] == ["speculators", "train"]
    options = [w.split("=")[0] for w in trainer if w.startswith("--")]
    shown = subprocess.run(
        [str(mooncake_python()), "-m", "speculators", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200", "PYTHONPATH": os.fspath(REPO)},
    ).stdout
    missing = [o for o in options if not re.search(rf"{re.escape(o)}\b", shown)]
    assert missing == [], f"speculators train --help does not show {missing}"


SPECFORGE_HEADING = (
    "### SpecForge's own online producer and consumer, through Mooncake (`hsx front specforge`)"
)


def _specforge_blocks() -> tuple[str, str]:
    text = (REPO / "README.md").read_text()
    at = text.index(f"\n{SPECFORGE_HEADING}\n")
    end = text.index("\n#", at + 1)
    section = text[at:end]
    [serve] = re.findall(r"```text\n(.*?)```", section, re.S)
    [run_config] = re.findall(r"```yaml\n(.*?)```", section, re.S)
    return serve, run_config


def test_the_hsx_front_specforge_line_parses_and_names_specforges_layer_ids() -> None:
    """The front line parses with hsx's parser; the drafter ids the README gives are
    hsx's layers in Kimi-K2.5's numbering (what the front answers SpecForge)."""
    serve, _ = _specforge_blocks()
    commands = _commands(serve)
    [front] = [c for c in commands if c[:3] == ["hsx", "front", "specforge"]]
    args = build_parser().parse_args(front[1:])
    assert args.handler == "hsx_async.cli.handlers.front:front_command"
    assert args.trainer == "specforge" and args.listen == "0.0.0.0:30000"
    [launch] = [c for c in commands if any(w.endswith("launch.sh") for w in c)]
    layers = next(w for w in launch if w.startswith("HSX_AUX_LAYERS=")).split("=")[1]
    ids = draft_ids("KimiK25ForConditionalGeneration", [int(k) for k in layers.split(",")], 61)
    text = (REPO / "README.md").read_text()
    assert f'"eagle_aux_hidden_state_layer_ids": {list(ids.ids or ())}' in text


@pytest.mark.mooncake
def test_the_run_config_block_is_one_specforge_takes() -> None:
    """SpecForge's own schema validates the README's ``deployment.disaggregated`` block,
    which points at the front's port and Mooncake master."""
    serve, run_config = _specforge_blocks()
    [front] = [c for c in _commands(serve) if c[:3] == ["hsx", "front", "specforge"]]
    args = build_parser().parse_args(front[1:])
    check = (
        "import sys, json, yaml\n"
        "from specforge.config.schema import DisaggregatedDeploymentConfig\n"
        "block = yaml.safe_load(sys.stdin.read())['deployment']['disaggregated']\n"
        "print(json.dumps(DisaggregatedDeploymentConfig(**block).model_dump()))\n"
    )
    shown = subprocess.run(
        [str(mooncake_python()), "-c", check],
        input=run_config,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": os.fspath(REPO)},
    ).stdout
    deployment = json.loads(shown)
    port = args.listen.split(":")[1]
    assert deployment["server_urls"] == [f"http://FRONT_NODE:{port}"]
    assert deployment["mooncake_master_server_addr"] == args.mooncake_master
    assert deployment["backend"] == "mooncake"
