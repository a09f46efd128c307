"""servelab: an LLM inference engine whose contested parts are plugins.

Public API: `LLM`, `SamplingParams`, `RequestOutput`, `build_engine`, `hookimpl`.
"""

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
