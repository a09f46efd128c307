"""Service per client, step by step, and the figures a fairness claim reads.

A client's service is its weighted tokens served (VTC's measure): `w_prompt`
per prompt token, counted at the step of the request's first token (its
prefill is done), and `w_output` per output token, at the step that sampled
it. A client is backlogged at a step when it has a request that arrived by
the step's start and has not finished. Over any stretch of steps in which
every client is backlogged, VTC keeps the difference between two clients'
service within `2 * max(w_prompt * L_input, w_output * M)` (Sheng et al.,
OSDI 2024, Theorem 4.6; L_input the longest prompt, M the KV tokens a batch
can hold): `client_service_gap_max` is the largest such difference measured.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _steps_of(value: Any) -> list[int]:
    return json.loads(value) if isinstance(value, str) else list(value or [])


def service_curves(
    requests: Sequence[Mapping], steps: Sequence[Mapping], w_prompt: float, w_output: float
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Clients (sorted), cumulative service after each step (steps x clients), and
    whether each client is backlogged at each step (steps x clients)."""
    clients = sorted({str(r["client"]) for r in requests if r.get("client") not in (None, "")})
    index = {int(s["step"]): i for i, s in enumerate(steps)}
    served = np.zeros((len(steps), len(clients)))
    backlog = np.zeros((len(steps), len(clients)), dtype=bool)
    starts = np.array([float(s["start_time"]) for s in steps])
    for row in requests:
        if row.get("client") in (None, ""):
            continue
        c = clients.index(str(row["client"]))
        token_steps = [index[t] for t in _steps_of(row.get("token_steps")) if t in index]
        if token_steps:
            served[token_steps[0], c] += w_prompt * float(row["prompt_tokens"])
            np.add.at(served[:, c], token_steps, w_output)
        done = row.get("finished_step")
        end = index.get(int(done), len(steps) - 1) + 1 if done not in (None, "") else len(steps)
        first = int(np.searchsorted(starts, float(row["arrival_time"])))  # first step after it came
        backlog[first:end, c] = True
    return clients, np.cumsum(served, axis=0), backlog


def contended_gap(cumulative: np.ndarray, backlog: np.ndarray) -> np.ndarray:
    """Per step, the service of the first client minus the second's, counted from
    the start of the current stretch in which both are backlogged (NaN outside one)."""
    diff = cumulative[:, 0] - cumulative[:, 1]
    both = backlog[:, 0] & backlog[:, 1]
    out = np.full(len(diff), np.nan)
    base = 0.0
    for i, on in enumerate(both):
        if on:
            if i == 0 or not both[i - 1]:
                base = diff[i - 1] if i > 0 else 0.0  # service before the stretch's first step
            out[i] = diff[i] - base
    return out


def fairness_figures(
    requests: Sequence[Mapping],
    steps: Sequence[Mapping],
    w_prompt: float = 1.0,
    w_output: float = 2.0,
) -> dict[str, float]:
    """The per-client figures of a run whose requests carry clients (else none)."""
    clients, cumulative, backlog = service_curves(requests, steps, w_prompt, w_output)
    if not clients:
        return {}
    out: dict[str, float] = {}
    both = backlog.all(axis=1)
    per_step = np.diff(cumulative, axis=0, prepend=0.0)
    contended = per_step[both].sum(axis=0)
    for c, name in enumerate(clients):
        mine = [r for r in requests if str(r.get("client")) == name]
        ttfts = [
            1000.0 * (float(r["first_token_time"]) - float(r["arrival_time"]))
            for r in mine
            if r.get("first_token_time") not in (None, "")
        ]
        out[f"ttft_mean_ms_{name}"] = float(np.mean(ttfts)) if ttfts else float("nan")
        out[f"arrival_share_pct_{name}"] = 100.0 * len(mine) / len(requests)
        total = contended.sum()
        out[f"service_share_pct_{name}"] = 100.0 * contended[c] / total if total else float("nan")
    if len(clients) >= 2:
        gaps = [
            np.nanmax(np.abs(_stretch_spread(cumulative[:, [a, b]], backlog[:, [a, b]])))
            for a in range(len(clients))
            for b in range(a + 1, len(clients))
        ]
        gap = float(max(gaps)) if gaps else 0.0
        prompt = max((float(r["prompt_tokens"]) for r in requests), default=0.0)
        capacity = max((float(s.get("kv_tokens_capacity") or 0) for s in steps), default=0.0)
        bound = 2.0 * max(w_prompt * prompt, w_output * capacity)
        out["client_service_gap_max"] = gap
        out["client_service_bound"] = bound
        out["client_gap_to_bound"] = gap / bound if bound else float("nan")
    return out


def _stretch_spread(cumulative: np.ndarray, backlog: np.ndarray) -> np.ndarray:
    """Per step, the largest |difference of service| over any interval of the current
    contended stretch ending there (0 outside one): max(d) - min(d) so far."""
    gap = contended_gap(cumulative, backlog)
    out = np.zeros(len(gap))
    low = high = 0.0
    for i, g in enumerate(gap):
        if np.isnan(g):
            low = high = 0.0
            continue
        low, high = min(low, g), max(high, g)
        out[i] = high - low
    return out
