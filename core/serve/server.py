"""`servelab serve`: the engine composed exactly as for `servelab` (parts, model,
device, engine options) plus the `serve` node, behind uvicorn.

On SIGINT or SIGTERM uvicorn stops accepting and lets in-flight requests finish
for `serve.grace_period` seconds; shortly before it ends, every open stream gets
an error event and `[DONE]` (and a response that does not stream a 503), which
aborts their engine requests; the engine loop then aborts whatever is left, and
the process exits 0 once every KV block is free (1, with a message, if one leaked).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from pathlib import Path

from servelab.contracts.kinds import KINDS
from servelab.engine.build import build_engine
from servelab.llm import EngineLoop
from servelab.model.loader import model_source
from servelab.serve.app import create_app
from servelab.serve.async_engine import AsyncEngine
from servelab.serve.config import serve_options
from servelab.serve.metrics import ServerMetrics
from servelab.serve.submission import mark_all
from servelab.serve.text import ChatTemplate

log = logging.getLogger(__name__)
NOT_ENGINE_NODES = ("serve", "workload", "run", "report", "cluster")
PART_NODES = ("scheduler", "allocator", "preemption", "attention", "executor")
NOT_ENGINE_GROUPS = ("experiment", "workload", "model")  # the model's name is served apart


def engine_choices(config: Mapping, hydra_choices: Mapping | None) -> dict:
    """The config-group choices that made the engine (`scheduler: chunked`, ...):
    Hydra's when composed by `servelab serve`, else each part node's name (the
    kind's default where absent), the device and the simulated hardware."""
    if hydra_choices is not None:
        return {k: v for k, v in hydra_choices.items() if k not in NOT_ENGINE_GROUPS}
    choices = {}
    for kind in PART_NODES:
        node = config.get(kind) or KINDS[kind].default
        choices[kind] = str(node.get("name") if isinstance(node, Mapping) else node)
    device = str((config.get("engine") or {}).get("device", "cpu"))
    choices["device"] = "cuda" if device.startswith("cuda") else device
    hardware = config.get("hardware")
    choices["hardware"] = hardware.get("name") if isinstance(hardware, Mapping) else hardware
    return choices


def model_folder(config: Mapping) -> str | None:
    node = config.get("model") or {}
    return node.get("path") if isinstance(node, Mapping) else None


def _uvicorn_server():
    import asyncio

    import uvicorn

    class Quiet(uvicorn.Server):
        """uvicorn's server, minus re-raising the signal after a graceful shutdown
        (which would end the process by that signal instead of exit status 0), and
        with every open stream ended (an error event, then `[DONE]`) shortly before
        the grace period runs out, so no client sees a cut connection."""

        grace_period = 10.0
        live: set = set()

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

        async def shutdown(self, sockets=None) -> None:
            close_at = max(0.0, self.grace_period - min(1.0, self.grace_period / 2))
            timer = asyncio.get_running_loop().call_later(close_at, mark_all, self.live)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Quiet


def header_timed(base: type, timeout: float) -> type:
    """uvicorn's HTTP protocol `base`, closing a connection that has not sent a whole
    request head within `timeout` seconds of connecting (a slow client holds no
    connection open indefinitely; a body that is slow answers 408 in the app)."""

    class HeaderTimed(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(timeout, self._head_late)

        def _head_late(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._head_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimed


def _http_protocol(timeout: float) -> type:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools is optional for uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return header_timed(base, timeout)


def _Uvicorn(config, grace_period: float, live: set):
    server = _uvicorn_server()(config)
    server.grace_period, server.live = grace_period, live
    return server


class Server:
    """Builds the engine and the app; `run()` serves until told to stop."""

    def __init__(self, config: Mapping, hydra_choices: Mapping | None = None) -> None:
        config = dict(config)
        self.choices = engine_choices(config, hydra_choices)
        self.options = serve_options(config.get("serve"))
        engine_config = {k: v for k, v in config.items() if k not in NOT_ENGINE_NODES}
        self.engine = build_engine(engine_config)
        self.aengine = AsyncEngine(EngineLoop(self.engine))
        folder = model_folder(config)
        node = config.get("model") or "tiny"
        shape = None if folder else model_source(node)  # a named shape's own chat template
        name = self.options["served_model_name"]
        if name is None:
            name = (
                Path(folder).name
                if folder
                else (node if isinstance(node, str) else node.get("name", "model"))
            )
        self.model_name = name
        self.metrics = ServerMetrics(name)
        self.metrics.bind(self.engine)
        self.aengine.on_finish = lambda out: self.metrics.request_done(out.metrics)
        self.app = create_app(self.aengine, self.options, name, ChatTemplate(folder, shape), self.metrics,
                              self.choices)  # fmt: skip
        self.uvicorn = None

    def make_uvicorn(self):
        import uvicorn

        config = uvicorn.Config(
            self.app,
            host=self.options["host"],
            port=self.options["port"],
            log_level=self.options["log_level"],
            timeout_graceful_shutdown=max(1, round(self.options["grace_period"])),
            lifespan="off",
            http=_http_protocol(self.options["header_timeout"]),
            limit_concurrency=self.options["max_connections"],
        )
        self.uvicorn = _Uvicorn(config, self.options["grace_period"], self.app.state.live)
        return self.uvicorn

    def run(self) -> int:
        """Serves, then shuts down cleanly; the exit status (0: every block free)."""
        self.aengine.start()
        try:
            self.make_uvicorn().run()
        finally:
            self.aengine.stop()
        return 0 if self.leaked_message() is None else 1

    def leaked_message(self) -> str | None:
        usage = self.engine.allocator.usage()
        total = usage.get("blocks_total", getattr(self.engine.allocator, "num_blocks", 0))
        held = total - usage.get("blocks_free", total)
        if held:
            message = f"servelab serve: {held} of {total} KV blocks still held at exit"
            print(message, file=sys.stderr)
            return message
        return None
