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
