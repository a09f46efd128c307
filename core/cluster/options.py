"""The `cluster:` config node: how many replicas, or how many prefill and decode instances,
and how a disaggregated cluster moves KV between them (docs/cluster.md).

    cluster: {replicas: 4}                                  # colocated: 4 engines behind the router
    cluster: {prefill: 2, decode: 2, link: nvlink}          # disaggregated (router=... picks
                                                            # the prefill instance)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from servelab.errors import ConfigError

CLUSTER_DEFAULTS: dict[str, Any] = {
    "replicas": 1,  # colocated engines, each serving prefill and decode
    "prefill": 0,  # disaggregated: prefill instances (with decode > 0)
    "decode": 0,  # disaggregated: decode instances
    "link": "nvlink",  # the link a KV transfer crosses: a name in servelab.cluster.links
    "transfer": "wait",  # a transfer the decode instance cannot admit: wait | recompute
    "decode_router": "least_load",  # the router part that picks a prefilled request's decode instance
    "record_steps": True,  # keep every step's record (off for very large runs)
    # a real disaggregated pair: its two processes here (local), or two Ray actors
    "backend": "local",  # local | ray
    "ray_address": "local",  # ray: local (started here) | auto | a cluster's address
    "kv_transport": "torch",  # ray: torch (a torch.distributed group) | object_store
}
TRANSFER_MODES = ("wait", "recompute")
BACKENDS = ("local", "ray")
KV_TRANSPORTS = ("torch", "object_store")


def cluster_options(node: Mapping | None) -> dict[str, Any]:
    """The node merged onto the defaults; an unknown key or a bad value is a ConfigError."""
    options = dict(CLUSTER_DEFAULTS)
    for key, value in (node or {}).items():
        if key not in CLUSTER_DEFAULTS:
            raise ConfigError(
                f"unknown cluster option {key!r}; accepted: {', '.join(CLUSTER_DEFAULTS)}"
            )
        options[key] = value
    for key in ("replicas", "prefill", "decode"):
        if not isinstance(options[key], int) or options[key] < 0:
            raise ConfigError(f"cluster.{key} must be an integer >= 0, got {options[key]!r}")
    if (options["prefill"] > 0) != (options["decode"] > 0):
        raise ConfigError(
            "a disaggregated cluster needs both cluster.prefill and cluster.decode >= 1, "
            f"got prefill={options['prefill']} decode={options['decode']}"
        )
    if options["replicas"] < 1 and not options["prefill"]:
        raise ConfigError(f"cluster.replicas must be >= 1, got {options['replicas']}")
    for key, accepted in (("backend", BACKENDS), ("kv_transport", KV_TRANSPORTS)):
        if options[key] not in accepted:
            raise ConfigError(
                f"cluster.{key} must be one of {', '.join(accepted)}, got {options[key]!r}"
            )
    if options["transfer"] not in TRANSFER_MODES:
        raise ConfigError(
            f"cluster.transfer must be one of {', '.join(TRANSFER_MODES)}, "
            f"got {options['transfer']!r}"
        )
    return options


def is_disaggregated(options: Mapping) -> bool:
    return options["prefill"] > 0
