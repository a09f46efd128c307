"""`construct`: the one place a config node becomes a part,
`{"name": "paged", "block_size": 16}` -> `PagedAllocator(block_size=16, **context)`."""

from __future__ import annotations

from typing import Any

from servelab.contracts.kinds import kind as get_kind
from servelab.registry.options import (
    check_option_types,
    check_options,
    describe_options,
    split_component,
)
from servelab.registry.plugin_manager import lookup


def construct(kind: str, spec: Any, **context: Any) -> Any:
    """Looks up the part named by `spec`, validates its options, returns
    `cls(**options, **context)` with `.name` set to the registered name."""
    unexpected = set(context) - get_kind(kind).context
    if unexpected:
        # an engine bug, not a user error: the kinds table is the contract
        raise TypeError(f"context {sorted(unexpected)} is not in KINDS[{kind!r}].context")
    name, options = split_component(spec, kind)
    cls = lookup(kind, name)
    accepted = describe_options(cls, kind)
    check_options(kind, name, options, accepted)
    check_option_types(cls, kind, name, options)
    part = cls(**options, **context)
    part.name = name  # the registered name, for error messages and reports
    # the node it was built from: another process (a tensor-parallel worker) builds its twin
    part.config_node = {"name": name, **options}
    return part


def attention_backend(spec: Any, model_config) -> Any:
    """The attention backend `spec` names (a name or `{name: ..., **options}`),
    shaped for `model_config`'s heads (one rank's under tensor parallelism)."""
    return construct(
        "attention",
        spec,
        num_heads=model_config.num_heads,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        scale=model_config.attention_scale,
    )
