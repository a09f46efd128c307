"""`draft`: a smaller model drafts (Leviathan et al. 2023; vLLM's draft-model
method). It runs as a small engine of its own, built from the same parts the
target's engine is: the `model` executor (the same checkpoint loader, kernels
and attention backends), an allocator of the configured kind for its own KV
cache, and `StepPlan`s through the same model runner. Each step it

1. brings every asked sequence up to date: the target kept some of its last
   drafts (and rejected the rest): the draft's K/V past the tokens both agree
   on is rolled back (`truncate`), then the new tokens are computed together
   with the first draft (one row per sequence: a prompt's prefill the first
   time, a few tokens after that);
2. drafts the rest, one token per sequence per forward, k - 1 more times.

`draft_sampling` says how a draft is chosen:
- `greedy` (the default): the draft model's argmax, a point mass. Verification
  keeps a draft when the target samples it, so seeded requests give exactly the
  tokens they give without a proposer.
- `request`: a sampled request's drafts are drawn at its own temperature, top-k,
  top-p and logit_bias (seeded from its seed, salted), and returned with their
  probabilities, so the target verifies them by rejection sampling
  (`servelab.model.rejection`). Where the target's distribution is spread out
  this keeps more drafts than the argmax does; a seeded request's tokens are then
  the same run after run but not those without a proposer. Greedy requests draft
  greedily either way.

A sequence the draft's cache has no room for gets no drafts that step (its
output never depends on drafts). Its cache is freed when the target's sequence
leaves (`on_finish`: finished, aborted, preempted).
"""

from __future__ import annotations

from typing import Any

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.proposer import Draft, DraftRequest, Proposer
from servelab.errors import ConfigError
from servelab.executor.sizing import parse_bytes
from servelab.registry.construct import attention_backend, construct
from servelab.step.plan import StepPlan
from servelab.step.sequence import SamplingParams, Sequence, SequenceStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)
DRAFT_SAMPLING = ("greedy", "request")
# xor-ed into a seeded request's seed: the draft's noise is not the target's (a rejected
# draft's residual must be drawn independently of how the draft was drawn)
DRAFT_SALT = 0xD4AF_7000


class DraftModelProposer(Proposer):
    description = "a smaller model drafts (greedy or sampled), with its own KV cache"

    def __init__(
        self,
        model: Any = None,
        kv_cache_memory: int | str = "32MiB",
        allocator: Any = "paged",
        attention: Any = "per_request",
        draft_sampling: str = "greedy",
        **common,
    ) -> None:
        super().__init__(**common)
        if draft_sampling not in DRAFT_SAMPLING:
            raise ConfigError(
                f"proposer draft_sampling={draft_sampling!r}: one of {', '.join(DRAFT_SAMPLING)} "
                "(greedy: the draft model's argmax; request: drawn at the request's sampling, "
                "verified by rejection sampling)"
            )
        self.sampled = draft_sampling == "request"
        if model is None:
            raise ConfigError(
                "proposer=draft needs its model: proposer.model=PATH (a checkpoint folder) "
                "or a named shape (e.g. tiny)"
            )
        target = self.engine_options
        self.max_model_len = int(target.get("max_model_len") or 1024)
        options = {
            **target,
            "kv_cache_memory": kv_cache_memory,
            "tensor_parallel_size": 1,
            "cuda_graphs": False,
            "gpu_memory_utilization": None,
        }
        self.executor = construct("executor", "model", model=model, hardware=None,
                                  engine_options=options)  # fmt: skip
        config = self.executor.model_config
        if config.vocab_size != self.vocab_size:
            raise ConfigError(
                f"the draft model {model!r} has a vocabulary of {config.vocab_size} ids, the "
                f"target {self.vocab_size}: a draft must share the target's tokenizer"
            )
        capacity = parse_bytes(kv_cache_memory, "proposer kv_cache_memory")
        tokens = capacity // self.executor.kv_bytes_per_token()
        self.allocator = construct("allocator", allocator, token_capacity=tokens,
                                   host_token_capacity=0, max_model_len=self.max_model_len)  # fmt: skip
        backend = attention_backend(attention, self.executor.attention_config)
        self.executor.bind(self.allocator, backend)
        # the draft's sampler keeps the distributions the drafts are drawn from
        self.executor.sampler.keep_probs = self.sampled
        self.seqs: dict[int, Sequence] = {}  # target seq_id -> the draft's sequence

    # -- the contract
    def propose(self, requests: list[DraftRequest]) -> list[Draft | list[int]]:
        drafts: dict[int, list[int]] = {r.seq_id: [] for r in requests}
        probs: dict[int, list[Any]] = {r.seq_id: [] for r in requests}
        running = [self._sync(r) for r in requests]
        rows = [(r, s) for r, s in zip(requests, running) if s is not None]
        # step 1: each sequence's uncomputed tokens (its catch-up) and the first draft
        rows = self._step(rows, drafts, probs, catch_up=True)
        for _ in range(1, max((r.max_drafts for r, _ in rows), default=0)):
            rows = [(r, s) for r, s in rows if len(drafts[r.seq_id]) < r.max_drafts]
            if not rows:
                break
            rows = self._step(rows, drafts, probs, catch_up=False)
        return [_answer(drafts[r.seq_id], probs[r.seq_id]) for r in requests]

    def on_finish(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.allocator.free(seq)

    # -- the draft's own steps
    def _sync(self, request: DraftRequest) -> Sequence | None:
        """The draft's sequence for `request`, its tokens the target's now and its
        K/V kept only where both agree."""
        tokens = list(request.token_ids)
        seq = self.seqs.get(request.seq_id)
        if seq is None:
            seq = Sequence(request.request_id, tokens, self._params(request))
            # its samples' output positions are the target's (seeded noise is keyed by them)
            seq.num_prompt_tokens = request.num_prompt_tokens
            seq.sample_index = request.sample_index
            seq.status = SequenceStatus.RUNNING
            self.seqs[request.seq_id] = seq
            return seq
        agree = _common_prefix(seq.token_ids, tokens)
        seq.token_ids = tokens
        if seq.num_computed_tokens > agree:
            seq.num_computed_tokens = agree
            self.allocator.truncate(seq, agree)
        return seq

    def _params(self, request: DraftRequest) -> SamplingParams:
        """How the draft chooses `request`'s drafts: greedily, or (`request` sampling,
        a sampled request) at its temperature, top-k, top-p and logit_bias (a shift of
        the target's distribution the draft can share), its seed salted."""
        target = request.params
        if not self.sampled or target is None or target.greedy:
            return GREEDY
        seed = None if target.seed is None else target.seed ^ DRAFT_SALT
        return SamplingParams(temperature=target.temperature, top_k=target.top_k,
                              top_p=target.top_p, logit_bias=target.logit_bias, seed=seed,
                              max_tokens=1 << 30, ignore_eos=True)  # fmt: skip

    def _step(self, rows: list, drafts: dict[int, list[int]], probs: dict[int, list[Any]],
              catch_up: bool) -> list:  # fmt: skip
        """One forward over `rows` (each computes its uncomputed tokens and samples
        the next, a draft, keeping the distribution of a sampled one); returns the
        rows that ran (the others had no room)."""
        plan = StepPlan()
        ran = []
        for request, seq in rows:
            if not catch_up:
                seq.token_ids.append(drafts[request.seq_id][-1])
            end = seq.num_tokens
            if seq.num_computed_tokens >= end:  # nothing new (never expected): redo the last
                seq.num_computed_tokens = end - 1
            if end > self.max_model_len or not self._room(seq, end):
                continue
            plan.add(seq, end - seq.num_computed_tokens)
            ran.append((request, seq))
        if not ran:
            return []
        plan.close(self.allocator.block_table, self.allocator.block_size, self.max_model_len)
        plan.copies = self.allocator.take_copies()
        if plan.copies:
            self.executor.apply(plan.copies)
        self.executor.sampler.last_probs = None
        sampled = self.executor.execute(plan)
        distributions = self.executor.sampler.last_probs  # None: every row was greedy
        if distributions is not None:
            row_of = {owner: row for row, owner in enumerate(sampled.owners)}
        for request, seq in ran:
            seq.num_computed_tokens = seq.num_tokens
            self.allocator.commit(seq)
            drafts[request.seq_id].append(sampled.get(seq.seq_id)[0])
            if distributions is not None and not seq.params.greedy:
                probs[request.seq_id].append(distributions[row_of[seq.seq_id]])
        return ran

    def _room(self, seq: Sequence, num_tokens: int) -> bool:
        """Allocates the draft's room for `num_tokens` tokens of `seq`, if it can."""
        if self.allocator.blocks_needed(seq, num_tokens) > self.allocator.num_free_blocks:
            return False
        cached = self.allocator.allocate(seq, num_tokens)
        seq.num_computed_tokens = max(seq.num_computed_tokens, cached)
        return True


def _answer(tokens: list[int], probs: list[Any]) -> Draft | list[int]:
    """Sampled drafts with their distributions, greedy ones as plain tokens."""
    if not probs or len(probs) != len(tokens):
        return tokens
    import torch

    return Draft(tokens, torch.stack(probs))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@hookimpl
def servelab_register_proposers():
    return {"draft": DraftModelProposer}
