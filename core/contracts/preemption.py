"""The preemption-policy contract: who gives up its KV blocks when they run out, and how."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from servelab.contracts.allocator import KVAllocator
    from servelab.step.sequence import Sequence


class PreemptionPolicy(abc.ABC):
    """Frees room when on-demand allocation runs out.

    Rules: the victim is the lowest priority (largest `priority` value), then
    the latest arrival; a preempted request loses nothing: its final tokens
    equal an unpreempted run. `preempt` returns the status the group goes to
    (WAITING for recompute, SWAPPED for swap).

    Engine-supplied context: none.
    """

    description: ClassVar[str] = ""

    def select_victim(self, running: list[list[Sequence]]) -> list[Sequence]:
        """Chooses the group to preempt among running groups (each a list of sequences)."""
        return max(running, key=lambda g: (g[0].priority, g[0].arrival_time, g[0].seq_id))

    @abc.abstractmethod
    def preempt(self, group: list[Sequence], allocator: KVAllocator) -> str:
        """Frees the group's device blocks; returns "waiting" (recompute) or "swapped"."""

    def resume(self, group: list[Sequence], allocator: KVAllocator) -> bool:
        """Brings a swapped group back if room allows; True when resumed."""
        if not allocator.can_swap_in(group):
            return False
        allocator.swap_in(group)
        return True
