"""A plugin whose allocator implements only part of the KVAllocator contract."""

from servelab import hookimpl
from servelab.contracts.allocator import KVAllocator


class HalfAllocator(KVAllocator):
    """Implements `blocks_needed` and `allocate`; the other abstract methods are missing."""

    def blocks_needed(self, seq, num_tokens):
        return 0

    def allocate(self, seq, num_tokens):
        return 0


@hookimpl
def servelab_register_allocators():
    return {"fake_half": HalfAllocator}
