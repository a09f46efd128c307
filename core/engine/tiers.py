"""The KV tier's place in `build_engine`: the part built from its node with the
engine's context, refused where it cannot work, attached to the allocator.

`kv_identity` is what kept K/V depends on besides the prefix: the model (a
named shape's random weights also on the seed), its KV shape, the dtype and
the block size. A disk tier files blocks under it, so blocks written for
another model or block size are never read as this one's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.executor import Executor
from servelab.contracts.kv_tier import KVTier
from servelab.errors import ConfigError
from servelab.model.config import NAMED_SHAPES
from servelab.model.loader import model_source
from servelab.registry.construct import construct


def kv_identity(model: Any, executor: Executor, opts: dict, block_size: int) -> dict[str, Any]:
    source = model_source(model)
    c = executor.model_config
    identity: dict[str, Any] = {
        "model": source if source in NAMED_SHAPES else str(Path(source).resolve()),
        "num_layers": c.num_layers,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "dtype": str(opts["dtype"]).removeprefix("torch."),
        "block_size": block_size,
    }
    if source in NAMED_SHAPES:  # random weights: a function of the seed
        identity["seed"] = int(opts["seed"])
    return identity


def build_kv_tier(
    node: Any, model: Any, executor: Executor, allocator: KVAllocator, opts: dict
) -> KVTier | None:
    """The tier `node` names, attached to `allocator`; None for a tier that keeps
    nothing (`none`), so the engine runs exactly as without tiers."""
    tier = construct(
        "kv_tier",
        node,
        block_bytes=executor.kv_bytes_per_token() * allocator.block_size,
        kv_identity=kv_identity(model, executor, opts, allocator.block_size),
        payloads=executor.device is not None,
    )
    if not tier.keeps_blocks:
        return None
    name = getattr(tier, "name", type(tier).__name__)
    if not executor.runs_tier_copies:
        raise ConfigError(
            f"kv_tier {name!r}: executor {getattr(executor, 'name', type(executor).__name__)!r} "
            "does not run a KV tier's copies; use executor=model or simulated, or kv_tier=none"
        )
    if executor.tp > 1:
        raise ConfigError(
            f"kv_tier {name!r} is not supported with tensor parallelism "
            f"(engine.tensor_parallel_size={executor.tp}); use kv_tier=none"
        )
    allocator.attach_tier(tier)
    return tier
