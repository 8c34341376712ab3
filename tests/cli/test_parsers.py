"""The parser modules name their handlers and restate a few domain constants (so that
``--help`` imports no domain module): every handler resolves, every restated value is
the domain's."""

from __future__ import annotations

import argparse

import pytest

from hsx_async.cli import build_parser, export, load_handler, serve
from hsx_async.dataset import export as dataset_export
from hsx_async.dataset.live import http as live_http
from hsx_async.dataset.live import serve as live_server
from hsx_async.protocol import DEFAULT_DUMP_ROOT
from hsx_async.server.fake.options import FakeOptions


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_command_names_a_handler_that_exists(name: str) -> None:
    spec = _commands()[name].get_default("handler")
    assert isinstance(spec, str) and ":" in spec, spec
    assert callable(load_handler(spec))


def test_export_choices_are_the_exporters() -> None:
    assert export.DTYPE_CHOICES == dataset_export.DTYPE_CHOICES
    assert export.SPECFORGE_GROUP_SIZE == dataset_export.SPECFORGE_GROUP_SIZE


def test_fake_server_dump_root_is_the_protocols() -> None:
    assert str(FakeOptions().dump_root) == DEFAULT_DUMP_ROOT
    assert _commands()["fake-server"].get_default("dump_root").as_posix() == DEFAULT_DUMP_ROOT


def test_serve_defaults_are_the_server_s() -> None:
    assert serve.MAX_STREAMS == live_server.MAX_STREAMS
    assert _commands()["serve"].get_default("max_streams") == live_server.MAX_STREAMS
    assert serve.MAX_CONNECTIONS == live_http.MAX_CONNECTIONS
    assert _commands()["serve"].get_default("max_connections") == live_http.MAX_CONNECTIONS
