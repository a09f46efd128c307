"""The `multi_client` workload: several clients, each its own request stream.

Every client has a name (the `client` its requests carry, so a fair scheduler
can count service per client), an arrival rate, prompt and output length
distributions, and a window `[start, stop)` in seconds in which it sends:
its first request at `start`, then Poisson (or gamma) gaps until `stop`. The
streams are merged by arrival time. One seeded generator draws everything,
client by client in the order given, so the same node gives the same requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from servelab.errors import ConfigError
from servelab.lab.distributions import LengthDist
from servelab.lab.request_builder import RequestBuilder, WorkloadRequest, check_keys
from servelab.step.sequence import finite_number

CLIENT_KEYS = ("name", "rate", "prompt_len", "output_len", "start", "stop", "cv")
# a heavy client sending four times a light one's rate, both for ten seconds
DEFAULT_CLIENTS = (
    {"name": "heavy", "rate": 8.0, "prompt_len": 64, "output_len": 64, "start": 0.0, "stop": 10.0},
    {"name": "light", "rate": 2.0, "prompt_len": 64, "output_len": 64, "start": 0.0, "stop": 10.0},
)


def multi_client_workload(
    vocab_size: int,
    max_model_len: int | None = None,
    clients: Sequence[Mapping[str, Any]] = DEFAULT_CLIENTS,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
) -> list[WorkloadRequest]:
    """Requests of every client in `clients` (each `{name, rate, prompt_len,
    output_len, start, stop, cv}`; `cv` of the gaps, 1 = Poisson), sorted by
    arrival time; request ids `<client>-<k>`."""
    if isinstance(clients, (str, Mapping)) or not clients:
        raise ConfigError("workload multi_client: clients must be a non-empty list of clients")
    build = RequestBuilder(vocab_size, max_model_len, seed, temperature, ignore_eos)
    requests: list[WorkloadRequest] = []
    names: set[str] = set()
    for i, node in enumerate(clients):
        spec = _client(node, f"workload multi_client: clients[{i}]")
        if spec["name"] in names:
            raise ConfigError(f"workload multi_client: client {spec['name']!r} is listed twice")
        names.add(spec["name"])
        requests.extend(_stream(build, spec, len(requests)))
    return sorted(requests, key=lambda r: r.arrival_time)  # stable: client order among ties


def _client(node: Any, what: str) -> dict[str, Any]:
    """One client's node, checked; `cv` defaults to 1 (Poisson)."""
    if not isinstance(node, Mapping):
        raise ConfigError(f"{what}: expected a mapping with {', '.join(CLIENT_KEYS)}, got {node!r}")
    check_keys(node, list(CLIENT_KEYS), what)
    name = node.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{what}: name must be a non-empty string, got {name!r}")
    spec: dict[str, Any] = {"name": name}
    for key, default in (("rate", None), ("start", 0.0), ("cv", 1.0)):
        value = finite_number(node.get(key, default))
        positive = key != "start"  # a window may open at 0; a rate or cv may not be 0
        if value is None or value < 0 or (positive and value == 0):
            rule = "> 0" if positive else ">= 0"
            raise ConfigError(
                f"{what}: {key} must be a finite number {rule}, got {node.get(key)!r}"
            )
        spec[key] = value
    stop = finite_number(node.get("stop"))
    if stop is None or stop <= spec["start"]:
        raise ConfigError(f"{what}: stop must be a finite number > start, got {node.get('stop')!r}")
    spec["stop"] = stop
    for key in ("prompt_len", "output_len"):
        if key not in node:
            raise ConfigError(f"{what}: missing {key}")
        spec[key] = LengthDist.from_node(node[key], f"{what}.{key}")
    return spec


def _stream(build: RequestBuilder, spec: dict[str, Any], first_index: int) -> list[WorkloadRequest]:
    times = _arrivals(build.rng, spec["rate"], spec["cv"], spec["start"], spec["stop"])
    prompts = spec["prompt_len"].sample(build.rng, len(times))
    outputs = spec["output_len"].sample(build.rng, len(times))
    name = spec["name"]
    return [
        build.random_request(
            first_index + k,
            int(prompts[k]),
            int(outputs[k]),
            arrival_time=float(times[k]),
            request_id=f"{name}-{k}",
            client=name,
            meta={"client": name},
        )
        for k in range(len(times))
    ]


def _arrivals(rng: np.random.Generator, rate: float, cv: float, start: float, stop: float):
    """The first arrival at `start`, then gamma gaps of mean 1/rate and
    coefficient of variation `cv` while the time stays before `stop`."""
    shape = 1.0 / cv**2
    times = [start]
    while True:
        t = times[-1] + rng.gamma(shape, 1.0 / (rate * shape))
        if t >= stop:
            return np.array(times)
        times.append(t)
