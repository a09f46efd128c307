"""Fixtures shared across the test folders."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from servelab.registry import plugin_manager


@pytest.fixture
def on_plugin_path(monkeypatch) -> Iterator[Callable[[Path, str], None]]:
    """`on_plugin_path(folder, module_prefix)` puts a distribution's folder on
    sys.path, as `pip install` would, and makes the process-wide plugin manager
    rebuild around it; after the test the manager is rebuilt without it and the
    modules whose names start with `module_prefix` are forgotten."""
    prefixes: list[str] = []

    def add(folder: Path, module_prefix: str) -> None:
        monkeypatch.syspath_prepend(str(folder))
        prefixes.append(module_prefix)
        plugin_manager.reset_plugin_manager()

    yield add
    plugin_manager.reset_plugin_manager()
    for name in [m for m in sys.modules if m.startswith(tuple(prefixes))]:
        del sys.modules[name]
