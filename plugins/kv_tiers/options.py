"""The options the built-in tiers share, checked once: the write policy and a
capacity given in blocks or in bytes."""

from __future__ import annotations

from servelab.errors import ConfigError
from servelab.executor.sizing import parse_bytes

POLICIES = ("write_back", "write_through")


def write_through(tier: str, policy: str) -> bool:
    """`policy` read: True for write_through; a ConfigError naming the choices otherwise."""
    if policy not in POLICIES:
        raise ConfigError(
            f"kv_tier {tier!r}: policy must be one of {', '.join(POLICIES)}, got {policy!r}"
        )
    return policy == "write_through"


def capacity_of(
    tier: str,
    blocks: int | None,
    size: int | str | None,
    block_bytes: int,
    prefix: str = "",
) -> int | None:
    """The most blocks a tier keeps: `blocks`, or `size` bytes of blocks; None: no
    limit of its own. Both given, or a value below one block, is a ConfigError."""
    names = f"{prefix}capacity_blocks", f"{prefix}capacity_bytes"
    if blocks is not None and size is not None:
        raise ConfigError(f"kv_tier {tier!r}: set {names[0]} or {names[1]}, not both")
    if blocks is not None:
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise ConfigError(
                f"kv_tier {tier!r}: {names[0]} must be an integer >= 1 (or null: no limit), "
                f"got {blocks!r}"
            )
        return blocks
    if size is None:
        return None
    num_bytes = parse_bytes(size, f"kv_tier {tier!r} {names[1]}")
    if num_bytes < block_bytes:
        raise ConfigError(
            f"kv_tier {tier!r}: {names[1]}={size!r} holds no block (one block takes "
            f"{block_bytes} bytes); raise it, or null: no limit"
        )
    return num_bytes // block_bytes
