"""`contiguous`: one slot of `max_model_len` tokens reserved per sequence at
admission — the pre-vLLM layout. It is the paged layout with
`block_size = max_model_len` and one block per sequence, so every attention
backend reads it through the same block table. A fork copies the slot on the
first write (copy-on-write of the one block)."""

from __future__ import annotations

from servelab.contracts.hookspecs import hookimpl
from servelab.plugins.allocators.paged import PagedAllocator


class ContiguousAllocator(PagedAllocator):
    description = "one max_model_len slot reserved per sequence (pre-vLLM layout)"

    def __init__(self, token_capacity: int, host_token_capacity: int, max_model_len: int) -> None:
        super().__init__(
            token_capacity,
            host_token_capacity,
            max_model_len,
            block_size=max_model_len,
            prefix_caching=False,
        )


@hookimpl
def servelab_register_allocators():
    return {"contiguous": ContiguousAllocator}
