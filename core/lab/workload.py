"""Request streams. A workload is a list of `WorkloadRequest`s: token ids,
sampling parameters, an arrival time (seconds after the run starts) and a
priority. A config node `{name: ..., **options}` picks a builder from
`WORKLOADS`; the options are that builder's keyword parameters (an unknown
one is a `ConfigError` listing the accepted ones). Rules every builder keeps:
- seeded: the same node and seed give the same requests, token for token;
- lengths are clipped to what the engine can serve: prompt >= 1 token,
  prompt + output <= `max_model_len` (when the engine's limit is known);
- arrival times are sorted and start at 0; "all at once" means every time is 0.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from servelab.errors import ConfigError
from servelab.lab.distributions import ARRIVALS, LENGTH_DISTS, LengthDist, arrival_times
from servelab.lab.multi_client import multi_client_workload
from servelab.lab.multi_turn import multi_turn_workload
from servelab.lab.public_traces import PUBLIC_TRACES, trace_source
from servelab.lab.request_builder import (
    FIRST_TOKEN_ID,
    RequestBuilder,
    WorkloadRequest,
    check_int,
    check_keys,
    clip_lengths,
    random_prompt,
)
from servelab.lab.trace import TRACE_KEYS, parse_trace_line, trace_workload

__all__ = [  # callers import every workload name from here, wherever it is defined
    "ARRIVALS",
    "FIRST_TOKEN_ID",
    "LENGTH_DISTS",
    "MIXED_LENGTHS",
    "TRACE_KEYS",
    "WORKLOADS",
    "LengthDist",
    "RequestBuilder",
    "WorkloadRequest",
    "arrival_times",
    "check_int",
    "check_keys",
    "clip_lengths",
    "interference_workload",
    "make_workload",
    "mixed_lengths_workload",
    "multi_client_workload",
    "multi_turn_workload",
    "parse_trace_line",
    "random_prompt",
    "synthetic_workload",
    "trace_source",
    "trace_workload",
    "workload_options",
]

# (prompt, output) tokens of the reference mix: short and long prompts and
# outputs side by side, so batching and memory policies differ visibly.
MIXED_LENGTHS = [
    (50, 200),
    (30, 20),
    (100, 500),
    (80, 60),
    (20, 300),
    (200, 40),
    (10, 120),
    (150, 250),
]


# -- builders: (vocab_size, max_model_len, **options) -> requests
#
# Each keeps its options in its own signature: they are the config node's keys
# (`workload_options`), listed in this order in an unknown-option error.


def mixed_lengths_workload(
    vocab_size: int,
    max_model_len: int | None = None,
    seed: int = 0,
    repeat: int = 1,
    scale: float = 1.0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    arrival: str = "all_at_once",
    rate: float = 8.0,
    cv: float = 1.0,
) -> list[WorkloadRequest]:
    """The eight requests of `MIXED_LENGTHS`, `repeat` times in order;
    `scale` multiplies every length (a smaller copy of the same shape)."""
    check_int("workload mixed_lengths: repeat", repeat, 1)
    if not scale > 0:
        raise ConfigError(f"workload mixed_lengths: scale must be > 0, got {scale!r}")
    build = RequestBuilder(vocab_size, max_model_len, seed, temperature, ignore_eos)
    mix = MIXED_LENGTHS * repeat
    times = arrival_times(len(mix), arrival, rate, cv, build.rng)
    return [
        build.random_request(
            i,
            round(p * scale),
            round(o * scale),
            arrival_time=float(times[i]),
            request_id=f"mixed-{i}",
        )
        for i, (p, o) in enumerate(mix)
    ]


_DEFAULT_PROMPT = {"dist": "uniform", "mean": 128, "std": 0, "min": 32, "max": 256}
_DEFAULT_OUTPUT = {"dist": "uniform", "mean": 128, "std": 0, "min": 16, "max": 256}


def synthetic_workload(
    vocab_size: int,
    max_model_len: int | None = None,
    num_requests: int = 64,
    prompt_len: Mapping | int = _DEFAULT_PROMPT,
    output_len: Mapping | int = _DEFAULT_OUTPUT,
    shared_prefix_len: int = 0,
    shared_fraction: float = 0.0,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    arrival: str = "all_at_once",
    rate: float = 8.0,
    cv: float = 1.0,
) -> list[WorkloadRequest]:
    """Seeded prompt and output lengths from `LengthDist`s, an arrival process,
    and optionally one shared system prompt of `shared_prefix_len` tokens put
    in front of the prompts of exactly round(shared_fraction * num_requests)
    requests (chosen at random); `prompt_len` is the length after it."""
    check_int("workload num_requests", num_requests, 1)
    check_int("workload shared_prefix_len", shared_prefix_len, 0)
    if not 0.0 <= shared_fraction <= 1.0:
        raise ConfigError(f"workload shared_fraction must be in [0, 1], got {shared_fraction!r}")
    build = RequestBuilder(vocab_size, max_model_len, seed, temperature, ignore_eos)
    rng = build.rng  # the draws below, in this order, fix the requests
    prompts = LengthDist.from_node(prompt_len, "workload.prompt_len").sample(rng, num_requests)
    outputs = LengthDist.from_node(output_len, "workload.output_len").sample(rng, num_requests)
    times = arrival_times(num_requests, arrival, rate, cv, rng)
    system = build.random_prompt(shared_prefix_len)
    num_shared = round(shared_fraction * num_requests) if shared_prefix_len else 0
    shared = set(rng.permutation(num_requests)[:num_shared].tolist())
    return [
        build.random_request(
            i,
            prompts[i],
            outputs[i],
            prefix=system if i in shared else None,
            arrival_time=float(times[i]),
            request_id=f"req-{i}",
            meta={"shared_prefix": i in shared},
        )
        for i in range(num_requests)
    ]


def interference_workload(
    vocab_size: int,
    max_model_len: int | None = None,
    num_decoders: int = 8,
    decoder_prompt_len: int = 32,
    decoder_output_len: int = 256,
    num_long: int = 4,
    long_prompt_len: int = 1024,
    long_output_len: int = 4,
    first_long_at: float = 0.05,
    long_every: float = 0.1,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
) -> list[WorkloadRequest]:
    """Long-prompt interference: `num_decoders` short-prompt, long-output
    requests arrive at 0 and decode steadily; `num_long` long prompts arrive at
    `first_long_at + k * long_every` seconds and must be prefilled while the
    decoders run (one long prefill can stall every decode)."""
    check_int("workload num_decoders", num_decoders, 0)
    check_int("workload num_long", num_long, 0)
    if first_long_at < 0 or long_every < 0:
        raise ConfigError("workload first_long_at and long_every must be >= 0 seconds")
    build = RequestBuilder(vocab_size, max_model_len, seed, temperature, ignore_eos)
    decoders = [
        build.random_request(
            i,
            decoder_prompt_len,
            decoder_output_len,
            request_id=f"decoder-{i}",
            meta={"kind": "decoder"},
        )
        for i in range(num_decoders)
    ]
    longs = [
        build.random_request(
            num_decoders + k,
            long_prompt_len,
            long_output_len,
            arrival_time=first_long_at + k * long_every,
            request_id=f"long-{k}",
            meta={"kind": "long"},
        )
        for k in range(num_long)
    ]
    return sorted(decoders + longs, key=lambda r: r.arrival_time)


WORKLOADS: dict[str, Callable[..., list[WorkloadRequest]]] = {
    "mixed_lengths": mixed_lengths_workload,
    "synthetic": synthetic_workload,
    "interference": interference_workload,
    "trace": trace_workload,
    "multi_client": multi_client_workload,
    "multi_turn": multi_turn_workload,
    **PUBLIC_TRACES,  # sharegpt, burstgpt, azure_llm, mooncake: servelab.lab.public_traces
}
_CONTEXT = ("vocab_size", "max_model_len")  # supplied by the runner, never by the user


def workload_options(name: str) -> dict[str, Any]:
    """The options a workload accepts, with their defaults."""
    params = inspect.signature(WORKLOADS[name]).parameters
    return {k: p.default for k, p in params.items() if k not in _CONTEXT}


def make_workload(
    node: Mapping[str, Any] | str, vocab_size: int, max_model_len: int | None = None
) -> list[WorkloadRequest]:
    """`{name: synthetic, num_requests: 8, ...}` -> requests. An unknown name or
    option is a `ConfigError` listing the accepted ones."""
    node = {"name": node} if isinstance(node, str) else dict(node)
    name = node.pop("name", None)
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; accepted: {', '.join(WORKLOADS)}")
    check_keys(node, list(workload_options(name)), f"workload {name!r}")
    return WORKLOADS[name](vocab_size=vocab_size, max_model_len=max_model_len, **node)
