"""`hybrid`: per victim, swap or recompute, whichever costs less for it.

Recomputing a victim prefills its whole KV again (work that grows faster than
its length: attention over the prefix), while swapping moves its blocks twice
over the host link (linear in its length). So short victims are recomputed and
long ones swapped: a victim whose KV (its computed tokens, summed over its
samples) reaches `break_even_tokens` is swapped. As with `swap`, a victim the
host pool cannot hold is recomputed (`swap`'s fallback, inherited).
"""

from servelab.contracts.hookspecs import hookimpl
from servelab.errors import ConfigError
from servelab.plugins.preemption.swap import SwapPolicy
from servelab.step.sequence import Sequence


class HybridPolicy(SwapPolicy):
    description = "swap victims with long KV, recompute short ones (break_even_tokens)"

    def __init__(self, break_even_tokens: int = 256) -> None:
        if (
            not isinstance(break_even_tokens, int)
            or isinstance(break_even_tokens, bool)
            or break_even_tokens < 0
        ):
            raise ConfigError(
                f"hybrid preemption: break_even_tokens must be an integer >= 0, got {break_even_tokens!r}"
            )
        self.break_even_tokens = break_even_tokens

    def should_swap(self, group: list[Sequence]) -> bool:
        """The choice rule: KV of at least `break_even_tokens` tokens is swapped."""
        return sum(seq.num_computed_tokens for seq in group) >= self.break_even_tokens


@hookimpl
def servelab_register_preemption_policies():
    return {"hybrid": HybridPolicy}
