"""`SchedulingPolicy`: the hooks a scheduler plugin overrides, and nothing else.

A scheduler is `SchedulerCore` (`servelab.scheduling.core`) plus a policy. The
core owns every correctness-critical operation: the queues, admission and its
block accounting through the allocator, the decode batch, preemption and
finishing. A policy only answers questions the core asks at well-defined points:

    on_add(group)                       a request was queued (after the core's checks)
    admission_order(candidates, plan)   who to try to admit this step, in order
    tokens_for(seq, start, budget)      how many tokens a sequence runs this step
    pick_victims()                      running groups to preempt before this step
    keeps_slot(group)                   a finished group holds its slot (and output) for now
    on_step_end(plan, finished)         after the forward: charge, demote, age
    on_request_end(group)               a request left (finished or aborted): drop what the policy kept for it
    policy_stats()                      extra figures for `stats()`

The core checks every answer (a group admitted twice, a victim that is not
running, a token count outside the budget raise `SchedulingPolicyError`), so a
policy cannot corrupt the block accounting. Policies read the core's state
(`waiting`, `running`, `swapped`, `allocator`, `max_num_seqs`, `step_count`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from servelab.errors import ServelabError

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


class SchedulingPolicyError(ServelabError):
    """A policy hook answered something the scheduler core refuses (a bug in the policy)."""


class SchedulingPolicy:
    """The eight hooks, with the defaults of plain continuous batching."""

    # True: in a step that starts with swapped groups or victims, the swapped groups are
    # admission candidates (resumed in `admission_order`'s order after the running phase)
    # instead of being resumed first, in queue order; groups preempted in the step are not
    swapped_in_admission_order = False

    def on_add(self, group: SequenceGroup) -> None:
        """`group` was queued (the core's checks passed: it can run)."""

    def admission_order(
        self, candidates: list[SequenceGroup], plan: StepPlan
    ) -> Iterable[SequenceGroup]:
        """The groups to try to admit this step, in order; the core admits them one
        at a time and stops at the first that does not fit. `candidates` are the
        waiting groups (and swapped ones, see `swapped_in_admission_order`) in the
        base order (the `order` option); `plan` is the step so far (read only). A
        generator is resumed only after the group it yielded was admitted."""
        return candidates

    def tokens_for(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens `seq` may run this step from `start` (0 to min(rest, budget)):
        here the whole rest or nothing."""
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
        """Figures added to `stats()`."""
        return {}
