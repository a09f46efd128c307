"""When the runner hands each workload request to the engine: at its arrival
time (open loop), or, for a follow-up, once the request it follows has finished
(closed loop, as a chat client sends its next turn only after the reply).

A follow-up is a `WorkloadRequest` with `after` set to another request's id.
Its `arrival_time` is then a delay: it arrives that many seconds after the
request it follows finished. With `continues`, its prompt is the followed
request's prompt and first reply, then its own `prompt_token_ids` (a chat's
next turn, carrying the reply the model actually generated). With a delay of
0 a follow-up arrives before the next step, whatever the clock: a workload of
follow-ups started all at once is served in the same order on any machine.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

from servelab.errors import ConfigError
from servelab.lab.request_builder import WorkloadRequest


def request_id(req: WorkloadRequest, index: int) -> str:
    """The id the runner gives `req`, the `index`-th request of its workload."""
    return req.request_id or f"req-{index}"


class ArrivalQueue:
    """The requests not yet handed to the engine: timed ones by arrival time,
    follow-ups parked under the id they follow until it finishes."""

    def __init__(self, requests: list[WorkloadRequest]) -> None:
        # timed requests in arrival order (stable), then follow-ups: the k-th is `req-k`
        # when it has no id of its own
        requests = sorted(requests, key=lambda r: (r.after is not None, r.arrival_time))
        self.total = len(requests)
        self._due: list[tuple[float, int, WorkloadRequest]] = []  # a heap: (time, order, req)
        self._followers: dict[str, list[tuple[int, WorkloadRequest]]] = {}
        self._prompts: dict[str, list[int]] = {}  # a followed request's prompt, as sent
        ids = {}
        for index, req in enumerate(requests):
            name = request_id(req, index)
            if name in ids:
                raise ConfigError(f"workload: request id {name!r} is used twice")
            ids[name] = req
        for index, req in enumerate(requests):
            named = replace(req, request_id=request_id(req, index))
            if req.after is None:
                self._due.append((req.arrival_time, index, named))
            else:
                self._check_follow_up(named, ids)
                self._followers.setdefault(req.after, []).append((index, named))
        heapq.heapify(self._due)

    @staticmethod
    def _check_follow_up(req: WorkloadRequest, ids: dict[str, WorkloadRequest]) -> None:
        seen = {req.request_id}
        step = req
        while step.after is not None:  # the chain must lead back to a timed request
            if step.after not in ids:
                raise ConfigError(
                    f"workload: request {req.request_id!r} follows {step.after!r}, "
                    "which is not in the workload"
                )
            if step.after in seen:
                raise ConfigError(f"workload: request {req.request_id!r} follows itself in a loop")
            seen.add(step.after)
            step = ids[step.after]

    def __bool__(self) -> bool:
        return bool(self._due or self._followers)

    def next_time(self) -> float | None:
        """The arrival time of the next timed request; None while only follow-ups wait."""
        return self._due[0][0] if self._due else None

    def pop_due(self, now: float) -> list[WorkloadRequest]:
        """The requests whose arrival time has come by `now`, in arrival order."""
        out = []
        while self._due and self._due[0][0] <= now:
            out.append(heapq.heappop(self._due)[2])
        return out

    def sent(self, req: WorkloadRequest) -> None:
        """Notes that `req` reached the engine (its prompt, for a `continues` follow-up)."""
        if req.request_id in self._followers:
            self._prompts[req.request_id] = req.prompt_token_ids

    def finished(self, name: str, reply: list[int], now: float) -> None:
        """Request `name` finished at `now` with `reply` (its first sample): its
        follow-ups become due `arrival_time` seconds later."""
        prompt = self._prompts.pop(name, [])
        for index, req in self._followers.pop(name, []):
            tokens = (
                prompt + reply + req.prompt_token_ids if req.continues else req.prompt_token_ids
            )
            due = replace(req, prompt_token_ids=tokens, arrival_time=now + req.arrival_time)
            heapq.heappush(self._due, (due.arrival_time, index, due))
