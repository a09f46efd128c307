"""The random processes a synthetic workload draws from: token-length
distributions (always clipped to [min, max]) and arrival processes (times in
seconds, the first at 0). Both take the builder's generator, so a seed fixes
every draw.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from servelab.errors import ConfigError
from servelab.lab.request_builder import check_keys

ARRIVALS = ("all_at_once", "poisson", "gamma")
LENGTH_DISTS = ("fixed", "uniform", "normal", "lognormal")


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
