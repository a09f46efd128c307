"""Prefill/decode disaggregation: not runnable yet.

A disaggregated cluster hands a prefilled request's KV cache to a decode instance, whose
allocator, scheduler and preemption admit it as a request whose prompt is already computed.
The engine has no entry point for such a request, so a disaggregated config is refused here
with an error that says so, rather than run as something it is not (re-prefilling the prompt
on the decode instance would price a transfer as a recomputation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from servelab.cluster.links import link
from servelab.errors import ConfigError


def run_disaggregated(config: Mapping, options: Mapping[str, Any]):
    link(options["link"])  # a misspelt link is reported first
    raise ConfigError(
        "cluster.prefill/cluster.decode (disaggregation) is not supported yet: the engine "
        "cannot admit a request whose prompt KV arrives from another instance; "
        "use cluster.replicas=N for a colocated cluster"
    )
