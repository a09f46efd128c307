"""`chunked`: chunked prefill with a per-step token budget (Sarathi). Running
decodes are scheduled first, one token each; the rest of
`max_num_batched_tokens` goes to prefill chunks of at most `chunk_size` tokens
per sequence, partially-prefilled sequences before new ones, oldest first. A
long prompt therefore never stalls the running decodes for more than a chunk."""

from __future__ import annotations

from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.scheduling import SchedulingPolicy
from servelab.step.sequence import Sequence


class ChunkedScheduler(SchedulingPolicy):
    description = "decodes first, then prefill chunks within a per-step token budget (Sarathi)"

    def __init__(self, chunk_size: int = 512, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigError(
                f"chunked scheduler: chunk_size must be an integer >= 1, got {chunk_size!r}"
            )
        self.chunk_size = chunk_size

    def tokens_for(self, seq: Sequence, start: int, budget: int) -> int:
        return max(0, min(seq.num_tokens - start, self.chunk_size, budget))


@hookimpl
def servelab_register_schedulers():
    return {"chunked": ChunkedScheduler}
