"""`prefix_affinity`: the replica that already caches the longest prefix of the prompt, when
that saves enough prefill to be worth its load; else the least loaded one (SGLang's
cache-aware router, llm-d's prefix scorer and Dynamo's KV router work this way).

A router cannot read a replica's cache, so it keeps an approximation: the chain hashes of the
full `block_size`-token blocks of every prompt it sent to each replica, at most
`cache_blocks` per replica, least recently routed evicted first. A request goes to the
replica with the longest such match when that match covers at least `cache_threshold` of its
prompt and, if that replica is busier than the least loaded one, saves at least
`min_saved_tokens` more prompt tokens than the least loaded one's match (a shared system
prompt is not worth waiting behind other requests; a long chat history is); else to the least
loaded replica. Balance wins over affinity when the most loaded replica has more than
`balance_abs_tokens` outstanding tokens above the least loaded and more than `balance_rel`
times its load. Ties go to the less loaded, then the lower index.
"""

from collections import OrderedDict
from collections.abc import Sequence

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.router import ReplicaState, RoutedRequest, Router
from servelab.errors import ConfigError


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of the full blocks of `tokens`: block i's hash covers tokens [0, (i+1)*block_size)."""
    hashes, parent = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return hashes


class ApproximateCache:
    """One replica's cached blocks as the router believes them: hash -> None, LRU order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def matched_blocks(self, hashes: list[int]) -> int:
        matched = 0
        for h in hashes:
            if h not in self.blocks:
                break
            matched += 1
        return matched

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class PrefixAffinityRouter(Router):
    description = "longest cached prefix, balanced against load"

    def __init__(
        self,
        num_replicas: int,
        block_size: int = 16,
        cache_threshold: float = 0.5,
        balance_abs_tokens: int = 16384,
        balance_rel: float = 1.5,
        cache_blocks: int = 100_000,
        min_saved_tokens: int = 256,
    ) -> None:
        super().__init__(num_replicas)
        for name, value in (("block_size", block_size), ("cache_blocks", cache_blocks)):
            if value < 1:
                raise ConfigError(f"prefix_affinity: {name} must be >= 1, got {value}")
        if min_saved_tokens < 0:
            raise ConfigError(
                f"prefix_affinity: min_saved_tokens must be >= 0, got {min_saved_tokens}"
            )
        if not 0.0 <= cache_threshold <= 1.0:
            raise ConfigError(
                f"prefix_affinity: cache_threshold must be in [0, 1], got {cache_threshold}"
            )
        self.block_size = block_size
        self.cache_threshold = cache_threshold
        self.balance_abs_tokens = balance_abs_tokens
        self.balance_rel = balance_rel
        self.min_saved_tokens = min_saved_tokens
        self.caches = [ApproximateCache(cache_blocks) for _ in range(num_replicas)]
        self._hashes: dict[str, list[int]] = {}  # request id -> its prompt's hashes, until routed

    def route(self, request: RoutedRequest, replicas: Sequence[ReplicaState]) -> int:
        loads = [r.outstanding_tokens for r in replicas]
        least = min(range(len(replicas)), key=lambda i: (loads[i], i))
        hashes = block_hashes(request.prompt_token_ids, self.block_size)
        self._hashes[request.request_id] = hashes
        top = max(loads)
        if top - loads[least] > self.balance_abs_tokens and top > self.balance_rel * loads[least]:
            return least
        matched = [self.caches[i].matched_blocks(hashes) for i in range(len(replicas))]
        best = min(range(len(replicas)), key=lambda i: (-matched[i], loads[i], i))
        prompt = max(1, len(request.prompt_token_ids))
        if not matched[best] or matched[best] * self.block_size < self.cache_threshold * prompt:
            return least
        saved = (matched[best] - matched[least]) * self.block_size  # over the least loaded
        if loads[best] > loads[least] and saved < self.min_saved_tokens:
            return least
        return best

    def on_routed(self, request: RoutedRequest, replica: int) -> None:
        hashes = self._hashes.pop(request.request_id, None)
        if hashes is None:
            hashes = block_hashes(request.prompt_token_ids, self.block_size)
        self.caches[replica].insert(hashes)


@hookimpl
def servelab_register_routers():
    return {"prefix_affinity": PrefixAffinityRouter}
