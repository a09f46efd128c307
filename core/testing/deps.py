"""Optional dependencies of the conformance kit, imported on first use.

The kit needs `transformers` (the reference model) and `hypothesis` (the
allocator state machine); both are servelab dev dependencies, not runtime
ones, so a missing one is reported with the command that installs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = "install servelab's dev extra: pip install 'servelab[dev]'"


def require(module: str, purpose: str) -> ModuleType:
    """Imports `module`; an ImportError saying what needs it and how to install it otherwise."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"servelab.testing needs `{module}` for {purpose}, and it is not installed; "
            f"{INSTALL_HINT}"
        ) from exc
