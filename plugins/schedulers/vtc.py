"""`vtc`: fair sharing across clients by a Virtual Token Counter (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024).

Every client (a request's `client`; None is one anonymous client) has a counter
of the weighted tokens it was served: `w_prompt` per prompt token when a
request is first admitted, `w_output` per output token as it is generated.
Admission takes the backlogged client (one with a request waiting) whose
counter is smallest, and that client's first request in the base order
(`order`); it stops at the first request that does not fit, like FCFS. A client
that becomes backlogged again after being idle is lifted to the smallest
counter of the backlogged clients (or, with none, to the counter of the last
client that left the backlog), so idle time earns no credit to burst with.
`served` keeps the weighted tokens without the lifts, for fairness figures.
"""

from __future__ import annotations

from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.scheduling import SchedulingPolicy
from servelab.step.sequence import SequenceGroup, finite_number


class VirtualTokenCounter(SchedulingPolicy):
    description = "fair share: admit the backlogged client with the least weighted service (VTC)"

    def __init__(self, w_prompt: float = 1.0, w_output: float = 2.0, **kwargs) -> None:
        super().__init__(**kwargs)
        for name, value in (("w_prompt", w_prompt), ("w_output", w_output)):
            number = finite_number(value)
            if number is None or number < 0:
                raise ConfigError(
                    f"vtc scheduler: {name} must be a finite number >= 0, got {value!r}"
                )
        if w_prompt == 0 and w_output == 0:
            raise ConfigError("vtc scheduler: w_prompt and w_output cannot both be 0")
        self.w_prompt = float(w_prompt)
        self.w_output = float(w_output)
        self.counters: dict[str | None, float] = {}  # client -> virtual counter (with lifts)
        self.served: dict[str | None, float] = {}  # client -> weighted tokens served
        self.charged_output: dict[str, int] = {}  # request id -> output tokens counted
        self.charged_prompt: set[str] = set()  # request ids whose prompt is counted
        self.last_left = 0.0  # counter of the last client whose backlog emptied

    def counter(self, client: str | None) -> float:
        return self.counters.get(client, 0.0)

    def charge(self, client: str | None, amount: float) -> None:
        self.counters[client] = self.counter(client) + amount
        self.served[client] = self.served.get(client, 0.0) + amount

    def on_add(self, group):  # the counter lift of a client that was not backlogged
        backlogged = {g.client for g in self.core.waiting if g is not group}
        if group.client not in backlogged:
            floor = min((self.counter(c) for c in backlogged), default=self.last_left)
            self.counters[group.client] = max(self.counter(group.client), floor)

    def admission_order(self, candidates, plan):
        """Swapped requests first (they were admitted and charged already), then the
        least-served backlogged client's first request, again after each admission."""
        allowed = list(super().admission_order(candidates, plan))
        swapped = [g for g in allowed if g.is_swapped]  # read before resuming changes it
        queues: dict[str | None, list[SequenceGroup]] = {}
        for group in allowed:  # each client's queue in base order
            if not group.is_swapped:
                queues.setdefault(group.client, []).append(group)
        yield from swapped
        while queues:
            client = min(queues, key=lambda c: (self.counter(c), self.core.order_key(queues[c][0])))
            group = queues[client].pop(0)
            yield group  # resumed only once it was admitted
            if not group.is_finished and group.request_id not in self.charged_prompt:
                # once per request: a preempted request admitted again was charged already
                self.charged_prompt.add(group.request_id)
                self.charge(group.client, self.w_prompt * group.seqs[0].num_prompt_tokens)
            if not queues[client]:
                del queues[client]
                self.last_left = self.counter(client)

    def on_step_end(self, plan, finished):  # output tokens, charged as they are generated
        for group in self.core.running + finished:
            produced = sum(s.num_output_tokens for s in group.seqs)
            new = produced - self.charged_output.get(group.request_id, 0)
            if new:
                self.charged_output[group.request_id] = produced
                self.charge(group.client, self.w_output * new)

    def on_request_end(self, group):
        self.charged_output.pop(group.request_id, None)
        self.charged_prompt.discard(group.request_id)


@hookimpl
def servelab_register_schedulers():
    return {"vtc": VirtualTokenCounter}
