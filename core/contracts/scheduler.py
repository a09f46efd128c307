"""The scheduler contract: `SchedulingPolicy`, the eight hooks a scheduler plugin overrides.

A scheduler is the engine's `SchedulerCore` (`servelab.scheduling.core`) driven by
a policy. The core owns every correctness-critical operation: the queues,
admission and its block accounting through the allocator, the decode batch,
preemption and finishing. A policy only answers what the core asks at
well-defined points:

    on_add(group)                       a request was queued (after the core's checks)
    admission_order(candidates, plan)   who to try to admit or resume this step, in order
    tokens_for(seq, start, budget)      how many tokens a sequence runs this step
    pick_victims()                      running groups to preempt before this step
    keeps_slot(group)                   a finished group holds its slot (and output) for now
    on_step_end(plan, finished)         after the forward: charge, demote, age
    on_request_end(group)               a request left (finished or aborted): drop what the policy kept for it
    policy_stats()                      extra figures for the scheduler's `stats()`

The core checks every answer (a group admitted twice, a victim that is not
running, a token count outside the budget raise `SchedulingPolicyError`), so a
policy cannot corrupt the block accounting. A policy reads the core's state
through `self.core` (`waiting`, `running`, `swapped`, `allocator`,
`max_num_seqs`, `num_running_seqs`, `step_count`, `order_key`), set when the
core is built around it.

Two options every policy takes: `admission` (`on_demand`: room for what runs
now, and the preemption policy frees a victim when blocks run out; `reserve`:
a group's worst case, prompt + max_tokens for each of its n samples, must fit
beside every admitted group's, so it never preempts) and `order`, the base
order of the candidates (`fcfs`: priority, arrival; `lpm`: priority, then the
longest prefix the allocator already caches, SGLang's cache-aware order).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from servelab.errors import ConfigError, ServelabError

if TYPE_CHECKING:
    from servelab.step.plan import StepPlan
    from servelab.step.sequence import Sequence, SequenceGroup

HOOKS = (
    "on_add",
    "admission_order",
    "tokens_for",
    "pick_victims",
    "keeps_slot",
    "on_step_end",
    "on_request_end",
    "policy_stats",
)
ADMISSION_MODES = ("reserve", "on_demand")
ORDERS = ("fcfs", "lpm")


class SchedulingPolicyError(ServelabError):
    """A policy hook answered something the scheduler core refuses (a bug in the policy)."""


class SchedulingPolicy(abc.ABC):
    """The eight hooks, with the defaults of plain continuous batching."""

    description: ClassVar[str] = ""
    core: Any  # the SchedulerCore asking (set when it is built around this policy)

    def __init__(self, admission: str = "on_demand", order: str = "fcfs") -> None:
        name = type(self).__name__
        if order not in ORDERS:
            raise ConfigError(
                f"unknown order {order!r} for scheduler {name}; accepted: {', '.join(ORDERS)}"
            )
        if admission not in ADMISSION_MODES:
            raise ConfigError(
                f"unknown admission {admission!r} for scheduler {name}; "
                f"accepted: {', '.join(ADMISSION_MODES)}"
            )
        self.admission = admission
        self.order = order

    def on_add(self, group: SequenceGroup) -> None:
        """`group` was queued (the core's checks passed: it can run)."""

    def admission_order(
        self, candidates: list[SequenceGroup], plan: StepPlan
    ) -> Iterable[SequenceGroup]:
        """The groups to try to admit (waiting) or resume (swapped) this step, in
        order; the core takes them one at a time and stops at the first that does
        not fit. `candidates` are the swapped groups not preempted in this step, by
        arrival, then the waiting ones in the base order (the `order` option);
        `plan` is the step so far (read only). A generator is resumed only after
        the group it yielded was admitted. Here: nobody while a group preempted in
        this step is swapped out (it would only be swapped back), else all."""
        return [] if plan.preempted and self.core.swapped else candidates

    def tokens_for(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens `seq` may run this step from `start` (0 to min(rest, budget)):
        here the whole rest or nothing, so the token budget must hold a whole prompt
        (`prefills_whole_prompts`)."""
        rest = seq.num_tokens - start
        return rest if rest <= budget else 0

    def pick_victims(self) -> list[SequenceGroup]:
        """Running groups to preempt before this step is planned (called once a step)."""
        return []

    def keeps_slot(self, group: SequenceGroup) -> bool:
        """Whether `group` (in a queue) keeps its slots and output for now once
        finished; the core asks again every step (static batching: until its batch ends)."""
        return False

    def on_step_end(self, plan: StepPlan, finished: list[SequenceGroup]) -> None:
        """After the forward and the core's update: `finished` left the queues."""

    def on_request_end(self, group: SequenceGroup) -> None:
        """`group` left the scheduler (finished or aborted): drop what is kept for it."""

    def policy_stats(self) -> dict[str, float]:
        """Figures added to the scheduler's `stats()`."""
        return {}


def prefills_whole_prompts(policy: type[SchedulingPolicy]) -> bool:
    """Whether `policy` runs a prompt in one step (it keeps the default
    `tokens_for`), so `max_num_batched_tokens` must hold a whole prompt."""
    return policy.tokens_for is SchedulingPolicy.tokens_for
