"""The README's commands for speculators' online job through ``hsx front`` cannot drift
from the code: the ``hsx front`` line parses with hsx's own parser, every option of the
``speculators train`` line is one speculators 0.9.0's trainer takes (its own ``--help``,
in .venv-mooncake), and the layer ids agree across the server, hsx and the trainer."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

from hsx_async.cli import build_parser
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
