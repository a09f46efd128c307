"""`ModelRunner`: one step's tensors in, one step's tokens out.

    batch  = runner.prepare(plan)            # input ids, metadata, attention plan (once per step)
    hidden = runner.run_model(batch)          # the model forward: the one place it runs
    tokens = runner.sample(hidden, batch)     # LM head on the sampled rows, one batched sample

Rules that keep a step cheap:
- the per-step cost grows with the number of sequences only through reading
  their lists (token ids, block tables); tokens are never looped over in Python;
- `run_model` is the single call site of the model's forward, so a decode CUDA
  graph runner (or `torch.compile`) wraps exactly one function;
- greedy rows skip the sampler's parameter tensors: one `argmax`, one `tolist`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from servelab.batch import AttentionMetadata, StepPlan
from servelab.interfaces import AttentionBackend, KVAllocator
from servelab.kv_cache import KVCache
from servelab.sequence import SamplingParams


@dataclass
class StepBatch:
    """What `prepare` built for one step; `run_model` and `sample` read it."""

    input_ids: torch.Tensor  # int64 [num_tokens], packed, decodes first
    meta: AttentionMetadata
    attn_plan: Any
    sample_rows: list[int]  # hidden row (index into meta.logits_indices) of each sample
    sample_params: list[SamplingParams]
    sample_positions: list[int]  # output position of the token each sample draws
    sample_indices: list[int]  # which of the n samples (seeded sampling tells them apart)
    sample_owners: list[int]  # seq_id that receives each sampled token
    all_greedy: bool


class ModelRunner:
    """Prepares a step's inputs, runs the model and samples, for one engine."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_cache: KVCache,
        allocator: KVAllocator,
        sampler,
        device: torch.device,
        generator: torch.Generator | None = None,
        compile: bool = False,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.allocator = allocator
        self.sampler = sampler
        self.device = device
        self.generator = generator
        # `torch.compile` of the model's forward; shapes change every step, so they
        # are dynamic from the start. The backend's forward stays eager
        # (`transformer.attend`): its per-step plan would only force recompiles.
        self.compiled_forward = torch.compile(model.forward, dynamic=True) if compile else None

    # -- inputs
    def prepare(self, plan: StepPlan) -> StepBatch:
        """Packs the step's tokens (decodes first, as the plan orders them) and
        builds the metadata and the backend's plan once for every layer.
        One pass over the scheduled sequences reads everything the step needs."""
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_mask: list[bool] = []
        rows: list[int] = []  # sampling rows: one per sampling sequence, n for a fork
        params: list[SamplingParams] = []
        positions: list[int] = []
        indices: list[int] = []
        owners: list[int] = []
        all_greedy = True
        num_sampling = 0  # sampling sequences so far: the hidden row of the next one
        num_decodes = 0
        still_decoding = True  # decodes come first: count them until the first other
        block_table = self.allocator.block_table
        for item in plan.scheduled:
            seq = item.seq
            start, count = item.start, item.num_query_tokens
            token_ids = seq.token_ids
            if count == 1:
                input_ids.append(token_ids[start])
            else:
                input_ids += token_ids[start : start + count]
            query_lens.append(count)
            seq_lens.append(start + count)
            tables.append(block_table(seq))
            samples = item.samples
            sample_mask.append(samples)
            num_outputs = len(token_ids) - seq.num_prompt_tokens
            if still_decoding:
                if count == 1 and samples and num_outputs > 0:
                    num_decodes += 1
                else:
                    still_decoding = False
            if not samples:
                continue
            p = seq.params
            if all_greedy and not p.greedy:
                all_greedy = False
            forks = p.n if num_outputs == 0 and p.n > 1 and seq.group.needs_fork else 1
            for k in range(forks):
                rows.append(num_sampling)
                params.append(p)
                positions.append(num_outputs)
                indices.append(k if forks > 1 else seq.sample_index)
                owners.append(seq.seq_id)
            num_sampling += 1
        meta = AttentionMetadata.from_lists(
            query_lens,
            seq_lens,
            tables,
            self.allocator.block_size,
            sample_mask=sample_mask,
            device=self.device,
            num_decodes=num_decodes,
        )
        attn_plan = self.backend.plan(meta)
        ids = torch.tensor(input_ids, dtype=torch.long)
        if self.device.type != "cpu":
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        return StepBatch(ids, meta, attn_plan, rows, params, positions, indices, owners, all_greedy)

    # -- the forward
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_plan: Any
    ) -> torch.Tensor:
        """The model's forward with this engine's KV cache and backend bound:
        `(input_ids, positions, attn_plan) -> hidden [num_tokens, hidden]`."""
        forward = self.compiled_forward or self.model
        return forward(input_ids, positions, self.kv_cache.layers, self.backend, attn_plan)

    def run_model(self, batch: StepBatch) -> torch.Tensor:
        """Hidden states of one step. The one place a step's forward runs; a
        graph runner replaces this method to replay decode steps."""
        return self.forward(batch.input_ids, batch.meta.positions, batch.attn_plan)

    # -- tokens
    def sample(self, hidden: torch.Tensor, batch: StepBatch) -> dict[int, list[int]]:
        """seq_id -> sampled tokens (one, or n for a prompt that forks now)."""
        if not batch.sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[batch.meta.logits_indices])
        if len(batch.sample_rows) != logits.shape[0]:
            logits = logits[torch.tensor(batch.sample_rows, device=logits.device)]
        if batch.all_greedy:
            # ties go to the lowest index, as the sampler's greedy rule
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = self.sampler.sample(
                logits,
                batch.sample_params,
                batch.sample_positions,
                self.generator,
                batch.sample_indices,
            ).tolist()
        sampled: dict[int, list[int]] = {}
        for owner, token in zip(batch.sample_owners, tokens):
            if owner in sampled:
                sampled[owner].append(token)
            else:
                sampled[owner] = [token]
        return sampled

    def execute(self, plan: StepPlan) -> dict[int, list[int]]:
        """prepare, run_model, sample: one step's sampled tokens by seq_id."""
        batch = self.prepare(plan)
        hidden = self.run_model(batch)
        return self.sample(hidden, batch)
