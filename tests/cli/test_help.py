"""``--help`` reads as help (issue 17, stumble 9): every option of every command says what
it does, fake-server shows its defaults and the fault kinds, and no reST markup leaks."""

from __future__ import annotations

import argparse
import re

import pytest

from hsx_async.cli import build_parser
from hsx_async.cli.fake_server import FAULT_HELP
from hsx_async.server.fake.options import ALL_FAULTS

_REST = re.compile(r"``|:(?:func|class|mod|data|meth|attr):`")


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_option_has_help_and_no_rest_markup(name: str) -> None:
    command = _commands()[name]
    missing = [
        "/".join(a.option_strings) or a.dest
        for a in command._actions
        if not isinstance(a, argparse._HelpAction) and not (a.help and a.help.strip())
    ]
    assert missing == [], f"hsx {name}: options without help: {missing}"
    text = command.format_help()
    assert not _REST.search(text), f"hsx {name} --help shows reST markup"


def test_fake_server_help_lists_defaults_and_every_fault() -> None:
    assert tuple(FAULT_HELP) == ALL_FAULTS  # the same names, in the same order
    text = " ".join(_commands()["fake-server"].format_help().split())
    assert "hidden size H of every row (default: 64)" in text
    assert "(default: 1,3,5)" in text and "(default: 30000)" in text
    for kind in ALL_FAULTS:
        assert f"{kind} {' '.join(FAULT_HELP[kind].split())}" in text, kind


def _option_help(command: argparse.ArgumentParser, action: argparse.Action) -> str:
    """What ``--help`` prints for one option, on one line."""
    formatter = command._get_formatter()
    return " ".join(formatter._expand_help(action).split()) if action.help else ""


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_default_is_said_once_where_it_means_something(name: str) -> None:
    """Issue 26: "(default: None)" on required arguments, a doubled default on `samples
    --min-len`, no default shown for prepare --workers, verify --fraction/--threads and the
    reference server's --aux-layers/--seed/--threads."""
    command = _commands()[name]
    assert "(default: None)" not in command.format_help()
    for action in command._actions:
        text = _option_help(command, action)
        assert text.count("default") <= 1, f"hsx {name} {action.dest}: {text}"
        flag = isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)
        if action.required or not action.option_strings or flag or action.dest == "help":
            assert "(default: " not in text or not action.required, f"{name} {action.dest}"
            continue
        if action.default is not None:
            assert "default" in text, f"hsx {name} {action.option_strings[0]}: {text}"


def test_the_defaults_the_issue_found_missing_are_shown() -> None:
    commands = _commands()
    for name, option, shown in [
        ("prepare", "--workers", "one per CPU"),
        ("verify", "--fraction", "(default: 1.0)"),
        ("verify", "--threads", "(default: 2)"),
        ("reference-server", "--aux-layers", "2,L/2,L-3"),
        ("reference-server", "--seed", "(default: 0)"),
        ("reference-server", "--threads", "the CPUs less one"),
        ("samples", "--max-len", "(default: 512)"),
    ]:
        command = commands[name]
        [action] = [a for a in command._actions if option in a.option_strings]
        assert shown in _option_help(command, action), (name, option)
    count = next(a for a in commands["samples"]._actions if "--count" in a.option_strings)
    assert "default" not in _option_help(commands["samples"], count)


def test_prepare_says_what_its_system_prompt_and_quarantine_are() -> None:
    """Issue 39: `--system-prompt` read "added when absent (keep), or the one" and
    `--quarantine` only "default: OUT's stem"."""
    command = _commands()["prepare"]
    shown = {a.dest: _option_help(command, a) for a in command._actions}
    assert shown["system_prompt"] == (
        "a system prompt: with --system keep, given to the conversations that have none; "
        "with --system override, to every conversation in place of its own"
    )
    assert shown["quarantine"] == (
        "where the refused conversations go, one JSON line each (id, line, reason) "
        "(default: beside --out, its name ending .quarantine.jsonl instead of .jsonl)"
    )
