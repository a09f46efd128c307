"""Fixtures for servelab-sjf's tests."""

from __future__ import annotations

import pytest
from servelab.registry.plugin_manager import get_plugin_manager

import servelab_sjf


@pytest.fixture
def sjf_plugin():
    """The plugin registered on servelab's plugin manager: through its entry
    point when the package is installed, otherwise at runtime for one test."""
    pm = get_plugin_manager()
    if pm.is_registered(servelab_sjf):
        yield servelab_sjf
        return
    pm.register(servelab_sjf, name="sjf")
    try:
        yield servelab_sjf
    finally:
        pm.unregister(servelab_sjf)
