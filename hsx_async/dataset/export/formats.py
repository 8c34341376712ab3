"""The export formats: one module each (defining ``FORMAT``, an
:class:`~.format.ExportFormat`), one line here. ``hsx export --format`` takes these names,
the live dataset's views are ``"hsx"`` and these (:mod:`hsx_async.dataset.live.dataset`),
and :func:`~.format.export_format` loads a format's module when it is used.

Pure, the standard library only: ``hsx export --help`` reads the names from here without
importing a format (``tests/cli/test_help_imports.py``).
"""

from __future__ import annotations

# name → the module that defines its FORMAT. A dict: a test registers a stand-in format.
FORMAT_MODULES: dict[str, str] = {
    "specforge": "hsx_async.dataset.export.specforge",
    "speculators": "hsx_async.dataset.export.speculators",
}


def format_names() -> tuple[str, ...]:
    """The formats registered now, in the registry's order."""
    return tuple(FORMAT_MODULES)
