"""The `serve` node of the Hydra config: where the server listens and its limits.
One table, typed once, like the engine's and the runner's options."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from servelab.errors import ConfigError
from servelab.registry.typed import check_value

SERVE_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 8000,
    "max_queued_requests": 256,  # requests in the engine at once; one more answers 429
    "served_model_name": None,  # None: the model's name (its folder, or the named shape)
    "api_key": None,  # set: every request needs `Authorization: Bearer <key>`
    "grace_period": 10.0,  # seconds in-flight requests may finish after SIGINT/SIGTERM
    "max_n": 16,  # the largest `n` a request may ask for
    "log_level": "info",
    "bench_concurrency": 64,  # `servelab bench serve`: requests in flight at once
}
SERVE_TYPES: dict[str, Any] = {
    "host": str,
    "port": int,
    "max_queued_requests": int,
    "served_model_name": str | None,
    "api_key": str | None,
    "grace_period": float,
    "max_n": int,
    "log_level": str,
    "bench_concurrency": int,
}


def serve_options(node: Mapping | None) -> dict[str, Any]:
    """The serve node with defaults filled in, every value checked."""
    node = dict(node or {})
    unknown = sorted(set(node) - set(SERVE_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"unknown serve option {unknown[0]!r}; the serve options are {sorted(SERVE_DEFAULTS)}"
        )
    options = {**SERVE_DEFAULTS, **node}
    for key, value in options.items():
        check_value(f"serve option {key}", value, SERVE_TYPES[key])
    if not 0 <= options["port"] < 65536:
        raise ConfigError(f"serve option port must be in [0, 65536), got {options['port']}")
    if min(options["max_queued_requests"], options["max_n"], options["bench_concurrency"]) < 1:
        raise ConfigError(
            "serve options max_queued_requests, max_n and bench_concurrency must be >= 1"
        )
    return options
