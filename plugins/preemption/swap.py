"""`swap`: copy the victim's blocks to the host pool and free the device
blocks; the group resumes before new admissions when room returns. When the
host pool is full it falls back to recompute."""

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.preemption import PreemptionPolicy
from servelab.step.sequence import Sequence


class SwapPolicy(PreemptionPolicy):
    description = "move the victim's KV to pinned host memory; recompute when the host pool is full"

    def should_swap(self, group: list[Sequence]) -> bool:
        """Whether to swap this victim (when the host pool can hold it); always, here."""
        return True

    def preempt(self, group: list[Sequence], allocator: KVAllocator) -> str:
        if self.should_swap(group) and allocator.can_swap_out(group):
            allocator.swap_out(group)
            return "swapped"
        for seq in group:
            allocator.free(seq)
        return "waiting"


@hookimpl
def servelab_register_preemption_policies():
    return {"swap": SwapPolicy}
