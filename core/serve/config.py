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
    # bounds that keep one request from hurting the others
    "max_body_bytes": 8 << 20,  # a larger request body answers 413
    "body_timeout": 30.0,  # seconds a request body may take to arrive (then 408)
    "header_timeout": 10.0,  # seconds a connection may take to send a request's headers
    "max_connections": 1024,  # open connections at once; one more answers 503
    "max_prompts": 64,  # prompts in one completion request
    "max_stop": 64,  # stop strings per request
    "max_stop_chars": 256,  # characters per stop string
    "max_stop_token_ids": 256,  # stop_token_ids per request
    "max_logit_bias": 1024,  # logit_bias entries per request
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
    "max_body_bytes": int,
    "body_timeout": float,
    "header_timeout": float,
    "max_connections": int,
    "max_prompts": int,
    "max_stop": int,
    "max_stop_chars": int,
    "max_stop_token_ids": int,
    "max_logit_bias": int,
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
    positive = ("max_queued_requests", "max_n", "bench_concurrency", "max_body_bytes",
                "body_timeout", "header_timeout", "max_connections", "max_prompts")  # fmt: skip
    bad = [k for k in positive if not options[k] > 0]
    if bad:
        raise ConfigError(f"serve options {', '.join(positive)} must be > 0; got {bad[0]}="
                          f"{options[bad[0]]}")  # fmt: skip
    counts = ("max_stop", "max_stop_chars", "max_stop_token_ids", "max_logit_bias")
    bad = [k for k in counts if options[k] < 0]
    if bad:
        raise ConfigError(f"serve option {bad[0]} must be >= 0, got {options[bad[0]]}")
    return options
