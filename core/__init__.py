"""servelab: an LLM inference engine whose contested parts are plugins.

Public API: `LLM`, `SamplingParams`, `RequestOutput`, `build_engine`, `hookimpl`.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError, PluginError, RequestError, ServelabError
from servelab.step.sequence import RequestOutput, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "build_engine",
    "hookimpl",
    "ConfigError",
    "PluginError",
    "RequestError",
    "ServelabError",
]


def __getattr__(name: str):
    # The engine pulls in torch and every plugin; import it only when asked.
    if name == "LLM":
        from servelab.llm import LLM

        return LLM
    if name == "build_engine":
        from servelab.engine.build import build_engine

        return build_engine
    raise AttributeError(f"module 'servelab' has no attribute {name!r}")


# Deprecated flat import paths -> the modules that hold their names: they keep
# working for one release, with a DeprecationWarning naming the new home.
MOVED_MODULES: dict[str, tuple[str, ...]] = {
    "servelab.scheduler_base": ("servelab.scheduling.core",),
    "servelab.contracts.scheduler_base": ("servelab.scheduling.core",),
    "servelab.contracts.scheduler_update": ("servelab.scheduling.transitions",),
    "servelab.scheduling.update": ("servelab.scheduling.transitions",),
    "servelab.scheduling.admission": ("servelab.scheduling.transitions",),
    "servelab.batch": ("servelab.step.plan", "servelab.step.metadata"),
    "servelab.sequence": ("servelab.step.sequence",),
    "servelab.options": ("servelab.registry.options", "servelab.registry.construct"),
    "servelab.interfaces": (
        "servelab.contracts.allocator",
        "servelab.contracts.scheduler",
        "servelab.contracts.preemption",
        "servelab.contracts.attention",
    ),
    "servelab.hookspecs": ("servelab.contracts.hookspecs",),
}

# Names that changed with their move: old module -> {old name: new name}
RENAMED_NAMES: dict[str, dict[str, str]] = {
    "servelab.scheduler_base": {"BaseScheduler": "SchedulerCore"},
    "servelab.contracts.scheduler_base": {"BaseScheduler": "SchedulerCore"},
    "servelab.contracts.scheduler_update": {
        "AfterTheForward": "QueueTransitions",
        "StepUpdate": "QueueTransitions",
    },
    "servelab.scheduling.update": {"StepUpdate": "QueueTransitions"},
    "servelab.scheduling.admission": {"Admission": "QueueTransitions"},
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves an old path as a module holding the names of its new homes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        homes = MOVED_MODULES[module.__name__]
        warnings.warn(
            f"{module.__name__} is deprecated and goes in the next release; "
            f"import from {' or '.join(homes)}",
            DeprecationWarning,
            stacklevel=2,  # warnings skips the import machinery's frames: the importing line
        )
        for home in homes:
            names = vars(importlib.import_module(home))
            module.__dict__.update({k: v for k, v in names.items() if not k.startswith("__")})
        for old, new in RENAMED_NAMES.get(module.__name__, {}).items():
            module.__dict__[old] = module.__dict__[new]


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
