"""The simulated executor's stand-in tokens, as pure functions.

`executor=simulated` samples no model: the token a sample draws at output position
p is a hash (splitmix64) of its request id, its sample index and p, shifted past
the model's EOS ids (`avoid_eos`: requests end at `max_tokens`, never at a
stand-in EOS). Anything that must know those tokens before the executor draws
them reads these functions: the `simulated` proposer drafts them (right at its
configured rates), tests predict them. An executor whose sampled tokens are
these sets `samples_stand_ins = True` on its class.

Torch-free and import-free of the rest of servelab: the plugin kinds that use it
(executors and proposers) may not import one another.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: one step per output position


def mix(x: int) -> int:
    """splitmix64's finaliser."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def sequence_key(request_id: str, sample_index: int) -> int:
    """One sample's key: a hash of its request id and sample index."""
    return mix((zlib.crc32(request_id.encode()) << 20) ^ sample_index)


def stand_in_token(key: int, position: int, vocab: int) -> int:
    """A deterministic token of one sample at one output position (before `avoid_eos`)."""
    return mix((key + position * GOLDEN) & MASK64) % vocab


def stand_in_tokens(keys: np.ndarray, positions: np.ndarray, vocab: int) -> np.ndarray:
    """`stand_in_token` over arrays (uint64 arithmetic wraps as `& MASK64` does), in
    place on one fresh array."""
    x = positions.astype(np.uint64)
    x *= _GOLDEN
    x += keys.astype(np.uint64, copy=False)
    x ^= x >> _30
    x *= _MIX1
    x ^= x >> _27
    x *= _MIX2
    x ^= x >> _31
    x %= np.uint64(vocab)
    return x


# splitmix64's constants as numpy scalars (uint64 arithmetic: no Python int per call)
_GOLDEN = np.uint64(GOLDEN)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_30, _27, _31 = np.uint64(30), np.uint64(27), np.uint64(31)


def avoid_eos(tokens: list[int], vocab: int, eos: Collection[int]) -> list[int]:
    """Requests end at max_tokens, never at a stand-in EOS: an EOS becomes the next id
    (in place; returns `tokens`)."""
    if eos and not frozenset(eos).isdisjoint(tokens):
        for i, token in enumerate(tokens):
            while token in eos:
                token = (token + 1) % vocab
            tokens[i] = token
    return tokens


def output_token(key: int, position: int, vocab: int, eos: Collection[int] = ()) -> int:
    """The token the simulated executor samples for the sample `key` at output position
    `position` (0: the token its prompt's last step samples)."""
    return avoid_eos([stand_in_token(key, position, vocab)], vocab, eos)[0]
