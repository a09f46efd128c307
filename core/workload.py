"""Request streams. A workload is a list of `WorkloadRequest`s: token ids,
sampling parameters, an arrival time (seconds after the run starts) and a
priority."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelab.errors import ConfigError
from servelab.sequence import SamplingParams


@dataclass
class WorkloadRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    request_id: str | None = None
    meta: dict = field(default_factory=dict)


# The seeds' example: A (50, 200), B (30, 20), C (100, 500) and five more of mixed lengths.
SEEDS_LENGTHS = [
    (50, 200),
    (30, 20),
    (100, 500),
    (80, 60),
    (20, 300),
    (200, 40),
    (10, 120),
    (150, 250),
]


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    # token 0 and the model's EOS are avoided only by chance; ignore_eos keeps lengths exact
    return rng.integers(2, vocab_size, size=length).tolist()


def seeds_workload(
    vocab_size: int, seed: int = 0, temperature: float = 0.0
) -> list[WorkloadRequest]:
    rng = np.random.default_rng(seed)
    return [
        WorkloadRequest(
            random_prompt(rng, p, vocab_size),
            SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True),
            request_id=f"seed-{i}",
        )
        for i, (p, o) in enumerate(SEEDS_LENGTHS)
    ]


WORKLOADS: dict[str, Callable[..., list[WorkloadRequest]]] = {"seeds": seeds_workload}


def make_workload(node: Mapping[str, Any], vocab_size: int) -> list[WorkloadRequest]:
    node = dict(node)
    name = node.pop("name", None)
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; accepted: {', '.join(WORKLOADS)}")
    try:
        return WORKLOADS[name](vocab_size=vocab_size, **node)
    except TypeError as err:
        raise ConfigError(f"workload {name!r}: {err}") from None
