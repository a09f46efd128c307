"""What every workload builder shares: the request a workload yields, the one
seeded generator a builder draws from, the length clipping that keeps a
request servable, and the checks that turn a bad option into a `ConfigError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servelab.errors import ConfigError
from servelab.step.sequence import SamplingParams

# 0 and 1 are often pad / EOS in the named shapes; ignore_eos keeps lengths exact anyway
FIRST_TOKEN_ID = 2


@dataclass
class WorkloadRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    request_id: str | None = None
    client: str | None = None  # who sent it (fair schedulers count service per client)
    meta: dict = field(default_factory=dict)
    # a follow-up (servelab.lab.arrivals): sent `arrival_time` seconds after request `after`
    # finished; with `continues`, after that request's prompt and reply (a chat's next turn)
    after: str | None = None
    continues: bool = False


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, vocab_size, size=length).tolist()


def clip_lengths(prompt_len: int, output_len: int, max_model_len: int | None) -> tuple[int, int]:
    """Keeps a request servable: prompt >= 1, output >= 1, prompt + output <= max_model_len."""
    prompt_len, output_len = max(1, int(prompt_len)), max(1, int(output_len))
    if max_model_len is not None:
        prompt_len = min(prompt_len, max_model_len - 1)
        output_len = min(output_len, max_model_len - prompt_len)
    return prompt_len, output_len


def check_keys(node: Mapping, accepted: list[str], what: str) -> None:
    unknown = [k for k in node if k not in accepted]
    if unknown:
        noun = "option" if len(unknown) == 1 else "options"
        raise ConfigError(
            f"unknown {noun} {', '.join(map(repr, unknown))} for {what}; accepted: {', '.join(accepted)}"
        )


def check_int(what: str, value: Any, minimum: int) -> None:
    if not (isinstance(value, int) and value >= minimum):
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}")


@dataclass
class RequestBuilder:
    """What every builder shares: one generator seeded with `seed` for all its
    random draws (the builder's order of draws fixes its requests), the
    sampling options, and the engine's length limit. Request `index` k samples
    with seed `seed * 100_003 + k`, so each request has its own stream."""

    vocab_size: int
    max_model_len: int | None
    seed: int
    temperature: float
    ignore_eos: bool
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def random_prompt(self, length: int) -> list[int]:
        return random_prompt(self.rng, length, self.vocab_size)

    def request(
        self, index: int, prompt: list[int], output_len: int, **fields: Any
    ) -> WorkloadRequest:
        """A request of exactly these prompt tokens; `fields` are `WorkloadRequest`'s."""
        params = SamplingParams(
            temperature=float(self.temperature),
            max_tokens=int(output_len),
            ignore_eos=bool(self.ignore_eos),
            seed=None if self.temperature == 0 else self.seed * 100_003 + index,
        )
        return WorkloadRequest(prompt, params, **fields)

    def random_request(
        self,
        index: int,
        prompt_len: int,
        output_len: int,
        prefix: list[int] | None = None,
        **fields: Any,
    ) -> WorkloadRequest:
        """`prefix` then random tokens, `prompt_len` of them, lengths clipped to
        what the engine serves (the prefix counts in the prompt, and is cut too
        when it alone is too long)."""
        prefix = prefix or []
        p, o = clip_lengths(len(prefix) + prompt_len, output_len, self.max_model_len)
        own = self.random_prompt(max(0, p - len(prefix)))
        return self.request(index, (prefix + own)[:p], o, **fields)
