"""Request streams. A workload is a list of `WorkloadRequest`s: token ids,
sampling parameters, an arrival time (seconds after the run starts) and a
priority.

A config node `{name: ..., **options}` picks a builder from `WORKLOADS`; the
options are that builder's keyword parameters (an unknown one is a
`ConfigError` listing the accepted ones). Rules every builder keeps:
- seeded: the same node and seed give the same requests, token for token;
- lengths are clipped to what the engine can serve: prompt >= 1 token,
  prompt + output <= `max_model_len` (when the engine's limit is known);
- arrival times are sorted and start at 0; "all at once" means every time is 0.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from servelab.errors import ConfigError
from servelab.step.sequence import SamplingParams


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

ARRIVALS = ("all_at_once", "poisson", "gamma")
LENGTH_DISTS = ("fixed", "uniform", "normal", "lognormal")
# 0 and 1 are often pad / EOS in the named shapes; ignore_eos keeps lengths exact anyway
FIRST_TOKEN_ID = 2


# -- building blocks


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, vocab_size, size=length).tolist()


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, always clipped to [min, max].

    - fixed: every length is `mean`;
    - uniform: integers in [min, max], both ends included;
    - normal: mean `mean`, standard deviation `std`, rounded;
    - lognormal: a log-normal whose own mean and standard deviation are
      `mean` and `std` (heavy right tail), rounded.
    """

    dist: str = "fixed"
    mean: float = 128
    std: float = 0.0
    min: int = 1
    max: int = 1024

    @classmethod
    def from_node(cls, node: Any, what: str) -> LengthDist:
        if isinstance(node, (int, float)) and not isinstance(node, bool):
            return cls("fixed", mean=node, min=1, max=max(1, int(node)))
        if not isinstance(node, Mapping):
            raise ConfigError(
                f"{what}: expected a length or {{dist, mean, std, min, max}}, got {node!r}"
            )
        check_keys(node, [f.name for f in cls.__dataclass_fields__.values()], what)
        spec = cls(**node)
        spec.validate(what)
        return spec

    def validate(self, what: str) -> None:
        if self.dist not in LENGTH_DISTS:
            raise ConfigError(
                f"{what}.dist: unknown {self.dist!r}; accepted: {', '.join(LENGTH_DISTS)}"
            )
        if not (
            isinstance(self.min, int) and isinstance(self.max, int) and 1 <= self.min <= self.max
        ):
            raise ConfigError(
                f"{what}: need integers 1 <= min <= max, got min={self.min!r} max={self.max!r}"
            )
        if self.dist != "uniform" and not self.mean > 0:
            raise ConfigError(f"{what}.mean must be > 0, got {self.mean!r}")
        if self.dist in ("normal", "lognormal") and not self.std >= 0:
            raise ConfigError(f"{what}.std must be >= 0, got {self.std!r}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "fixed":
            raw = np.full(n, float(self.mean))
        elif self.dist == "uniform":
            raw = rng.integers(self.min, self.max + 1, size=n).astype(float)
        elif self.dist == "normal":
            raw = rng.normal(self.mean, self.std, size=n)
        else:  # lognormal, parametrised by the mean and std of the lengths themselves
            sigma2 = math.log1p((self.std / self.mean) ** 2)
            raw = rng.lognormal(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2), size=n)
        return np.clip(np.rint(raw), self.min, self.max).astype(int)


def arrival_times(
    n: int, arrival: str, rate: float, cv: float, rng: np.random.Generator
) -> np.ndarray:
    """Arrival times in seconds, the first at 0.

    - all_at_once: every request at 0;
    - poisson: exponential gaps of mean 1 / rate;
    - gamma: gamma gaps of mean 1 / rate and coefficient of variation `cv`
      (cv = 1 is Poisson, cv > 1 burstier, cv < 1 more regular).
    """
    if arrival not in ARRIVALS:
        raise ConfigError(f"workload arrival: unknown {arrival!r}; accepted: {', '.join(ARRIVALS)}")
    if arrival == "all_at_once" or n == 0:
        return np.zeros(n)
    if not (isinstance(rate, (int, float)) and rate > 0):
        raise ConfigError(
            f"workload rate must be > 0 requests/s for {arrival} arrivals, got {rate!r}"
        )
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    else:
        if not (isinstance(cv, (int, float)) and cv > 0):
            raise ConfigError(f"workload cv must be > 0 for gamma arrivals, got {cv!r}")
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


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


# -- builders: (vocab_size, max_model_len, **options) -> requests
#
# Each keeps its options in its own signature: they are the config node's keys
# (`workload_options`), listed in this order in an unknown-option error.


def seeds_workload(
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
    """The seeds' heterogeneous mix (`SEEDS_LENGTHS`), `repeat` times in order;
    `scale` multiplies every length (a smaller copy of the same shape)."""
    check_int("workload seeds: repeat", repeat, 1)
    if not scale > 0:
        raise ConfigError(f"workload seeds: scale must be > 0, got {scale!r}")
    build = RequestBuilder(vocab_size, max_model_len, seed, temperature, ignore_eos)
    mix = SEEDS_LENGTHS * repeat
    times = arrival_times(len(mix), arrival, rate, cv, build.rng)
    return [
        build.random_request(
            i,
            round(p * scale),
            round(o * scale),
            arrival_time=float(times[i]),
            request_id=f"seed-{i}",
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
    decoders run (the seeds' "a 4096-token prompt stalls every decode")."""
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


TRACE_KEYS = ("prompt_len", "prompt_token_ids", "output_len", "arrival_time", "priority")


def trace_workload(
    vocab_size: int,
    max_model_len: int | None = None,
    path: str | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
) -> list[WorkloadRequest]:
    """Replays a JSONL trace: one JSON object per line with `prompt_len` or
    `prompt_token_ids`, `output_len`, optional `arrival_time` (seconds, default
    0; multiplied by `time_scale`) and `priority` (default 0). Blank lines are
    skipped; a bad line is a `ConfigError` naming the file, the line and the
    problem. Random prompt tokens for `prompt_len` come from `seed`."""
    if not path:
        raise ConfigError(
            "workload trace needs `path`: a JSONL file, e.g. workload.path=trace.jsonl"
        )
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise ConfigError(f"workload trace: no such file {str(file)!r}")
    build = RequestBuilder(vocab_size, max_model_len, seed, temperature, ignore_eos)
    requests = []
    with file.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{file}:{lineno}"
            prompt, output_len, arrival, priority = parse_trace_line(line, where, vocab_size)
            if isinstance(prompt, int):
                prompt = build.random_prompt(prompt)
            # a trace is replayed as written: too long is an error, never clipped
            if max_model_len is not None and len(prompt) + output_len > max_model_len:
                raise ConfigError(
                    f"{where}: prompt ({len(prompt)} tokens) + output_len ({output_len}) exceeds "
                    f"max_model_len={max_model_len}"
                )
            requests.append(
                build.request(
                    lineno,
                    prompt,
                    output_len,
                    arrival_time=arrival * time_scale,
                    priority=priority,
                    request_id=f"trace-{lineno}",
                )
            )
    if not requests:
        raise ConfigError(f"workload trace: {file} holds no requests")
    requests.sort(key=lambda r: r.arrival_time)  # stable: file order among equal times
    return requests


def parse_trace_line(
    line: str, where: str, vocab_size: int
) -> tuple[int | list[int], int, float, int]:
    """One trace line -> (prompt length or token ids, output_len, arrival_time, priority)."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(item).__name__}")
    unknown = [k for k in item if k not in TRACE_KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; accepted: {', '.join(TRACE_KEYS)}")
    if ("prompt_len" in item) == ("prompt_token_ids" in item):
        raise ConfigError(f"{where}: give exactly one of prompt_len and prompt_token_ids")

    def positive_int(key: str) -> int:
        value = item.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        return value

    if "prompt_len" in item:
        prompt: int | list[int] = positive_int("prompt_len")
    else:
        ids = item["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            raise ConfigError(f"{where}: prompt_token_ids must be a non-empty list of token ids")
        bad = [
            t
            for t in ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
        ]
        if bad:
            raise ConfigError(
                f"{where}: token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})"
            )
        prompt = ids
    if "output_len" not in item:
        raise ConfigError(f"{where}: missing output_len")
    output_len = positive_int("output_len")
    arrival = item.get("arrival_time", 0.0)
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not arrival >= 0:
        raise ConfigError(f"{where}: arrival_time must be a number >= 0 (seconds), got {arrival!r}")
    priority = item.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ConfigError(f"{where}: priority must be an integer, got {priority!r}")
    return prompt, output_len, float(arrival), priority


WORKLOADS: dict[str, Callable[..., list[WorkloadRequest]]] = {
    "seeds": seeds_workload,
    "synthetic": synthetic_workload,
    "interference": interference_workload,
    "trace": trace_workload,
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
