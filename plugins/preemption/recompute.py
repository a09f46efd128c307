"""`recompute`: free the victim's blocks; it returns to the front of the waiting
queue and its prompt + generated tokens are prefilled again (the prefix cache
may serve part of them)."""

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.preemption import PreemptionPolicy
from servelab.step.sequence import Sequence


class RecomputePolicy(PreemptionPolicy):
    description = "drop the victim's KV and prefill it again later"

    def preempt(self, group: list[Sequence], allocator: KVAllocator) -> str:
        for seq in group:
            allocator.free(seq)
        return "waiting"


@hookimpl
def servelab_register_preemption_policies():
    return {"recompute": RecomputePolicy}
