"""How every ``hsx <command> --help`` shows an option's default: once, where it means
something (issue 26: no "(default: None)" on a required argument, no default said twice,
none missing)."""

from __future__ import annotations

import argparse
from typing import Any

_FLAGS = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._HelpAction,
    argparse._VersionAction,
)


class HelpFormatter(argparse.HelpFormatter):
    """``(default: X)`` after an option's help, unless the option is required, a flag or
    positional, has no default (None), or its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or action.required
            or not action.option_strings
            or isinstance(action, _FLAGS)
            or action.default is None
            or action.default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)"


class RawEpilogHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The same, with the description and epilog kept as written (a table of lines)."""


class CommandParser(argparse.ArgumentParser):
    """Every command's parser: :class:`HelpFormatter` unless the command names its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
