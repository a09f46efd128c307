"""`ModelRunner`: one step's tensors in, one step's tokens out.

    batch  = runner.prepare(plan)            # input ids, metadata, attention plan (once per step)
    hidden = runner.run_model(batch)          # the model forward: the one place it runs
    tokens = runner.sample(hidden, batch)     # LM head on the sampled rows, one batched sample

Rules that keep a step cheap: the cost grows with the number of sequences only through
reading their lists (tokens are never looped over in Python); `run_model` is the forward's
one call site, so a decode graph runner or `torch.compile` wraps one function; greedy rows
take one `argmax`; the CPU path pays nothing for CUDA's pinned staging and decode graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from servelab.contracts.allocator import KVAllocator
from servelab.contracts.attention import AttentionBackend
from servelab.executor.cuda_graphs import DecodeGraphRunner
from servelab.executor.forward import ModelForward
from servelab.executor.kv_cache import KVCache
from servelab.executor.staging import StepStaging
from servelab.model.rejection import verify_by_rejection
from servelab.model.sampler import sample_isolating_rows
from servelab.step.metadata import AttentionMetadata
from servelab.step.plan import SampledTokens, StepPlan
from servelab.step.sequence import SamplingParams
from servelab.step.verify import DraftedHistory, kept_rows

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """What `prepare` built for one step; `run_model` and `sample` read it."""

    input_ids: torch.Tensor  # int64 [num_tokens], packed, decodes first
    meta: AttentionMetadata
    attn_plan: Any  # None for a step the decode graphs replay (they keep their own plan)
    sample_rows: Sequence[int]  # hidden row (index into meta.logits_indices) of each sample
    sample_params: list[SamplingParams]
    sample_positions: list[int]  # output position of the token each sample draws
    sample_indices: list[int]  # which of the n samples (seeded sampling tells them apart)
    sample_owners: list[int]  # seq_id that receives each sampled token
    all_greedy: bool  # every row takes the raw logits' argmax (no sampling, no processing)
    sample_seqs: list | None = None  # each sample row's sequence (logits processing reads it)
    # (seq, hidden row, first, last): rows first.. score prompt tokens first..last (inclusive)
    prompt_rows: list | None = None
    # speculative decoding: (first sample row, drafts) of each row with drafts, whose
    # 1 + len(drafts) consecutive samples verification keeps a prefix of
    verify: list[tuple[int, list[int]]] | None = None
    # those of sampled rows whose drafts carry probabilities: (first sample row, drafts,
    # their probabilities), verified by rejection sampling (`servelab.model.rejection`)
    rejection: list[tuple[int, list[int], Any]] | None = None


class ModelRunner:
    """Prepares a step's inputs, runs the model and samples, for one engine."""

    def __init__(
        self,
        model_forward: ModelForward,
        backend: AttentionBackend,
        kv_cache: KVCache,
        allocator: KVAllocator,
        sampler,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> None:
        self.model_forward = model_forward  # torch's ops, compiled or not, or the C++ kernels
        self.backend = backend
        self.kv_cache = kv_cache
        self.allocator = allocator
        self.sampler = sampler
        self.logprobs_k = -1  # this step's plan.logprobs_k: the most alternatives asked; -1: none
        self.device = device
        self.generator = generator
        # CUDA: one pinned buffer for the step's inputs, one upload per step
        self.staging = None if device.type == "cpu" else StepStaging(device)
        # set by enable_decode_graphs (engine.cuda_graphs); None: run_model calls forward
        self.graphs: DecodeGraphRunner | None = None
        self.graphs_status = "off (engine.cuda_graphs=false)"

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> str:
        """Routes `run_model` through a `DecodeGraphRunner` and captures its
        graphs now (call it once the KV cache exists, before the first step).
        Where graphs cannot run (no CUDA device, a backend that is not
        graph-safe) every step stays eager, with a warning; `graphs_status`
        (also returned) says which happened."""
        runner = DecodeGraphRunner(
            self.forward,
            self.backend,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            block_size=self.allocator.block_size,
            device=self.device,
        )
        if runner.enabled:
            begin = time.perf_counter()
            self.capture_graphs(runner, max_num_seqs, max_model_len)
            self.graphs_status = (
                f"captured: batch sizes {list(runner.buckets)} "
                f"in {time.perf_counter() - begin:.1f} s"
            )
        else:
            self.graphs_status = f"eager: {runner.disabled_reason}"
            log.warning(
                "engine.cuda_graphs=true, but decode runs eagerly: %s", runner.disabled_reason
            )
        self.graphs = runner
        return self.graphs_status

    def capture_graphs(
        self, graphs: DecodeGraphRunner, max_num_seqs: int, max_model_len: int
    ) -> None:
        """Captures `graphs` (a tensor-parallel runner has every rank capture with it)."""
        graphs.capture()

    @property
    def cpu_kernels(self) -> bool:
        """Whether the model runs through servelab's C++ CPU kernels."""
        return self.model_forward.cpu_kernels

    # -- inputs
    def prepare(self, plan: StepPlan) -> StepBatch:
        """The step's tokens (its rows in order: decodes first), its metadata and
        the backend's plan, built once for every layer from the plan's arrays;
        per-row Python work only for rows that sample with parameters or score
        prompt tokens."""
        input_ids = plan.input_ids
        staging = self.staging
        if staging is not None:  # the ids go up in the metadata's copy
            staging.begin()
            staging.put("input_ids", input_ids, torch.int64)
        meta = AttentionMetadata.from_rows(
            plan.starts,
            plan.counts,
            plan.tables,
            self.allocator.block_size,
            None if plan.num_decodes == len(plan.seqs) else plan.samples,  # decodes all sample
            self.device,
            num_one_query_seqs=plan.num_decodes,
            staging=staging,
            one_query_slots=plan.decode_slots,
            draft_counts=plan.draft_counts,
        )
        attn_plan, ids = self._plan_and_ids(meta, input_ids)
        if plan.draft_counts is None:
            batch = StepBatch(ids, meta, attn_plan, *_sample_rows(plan))
        else:
            verify: list[tuple[int, list[int]]] = []
            rejection: list[tuple[int, list[int], Any]] = []
            batch = StepBatch(ids, meta, attn_plan, *_sample_rows(plan, verify, rejection))
            batch.verify, batch.rejection = verify, rejection
        batch.prompt_rows = _prompt_rows(plan)
        return batch

    def _plan_and_ids(
        self, meta: AttentionMetadata, input_ids: list[int]
    ) -> tuple[Any, torch.Tensor]:
        """The backend's plan of the step (None when a decode graph will replay it:
        the graph keeps the plan it was captured with) and the input ids tensor
        (the staged view on a device, where `prepare` put them)."""
        graphs = self.graphs
        if graphs is not None and graphs.bucket_for(meta) is not None:
            attn_plan = None
        else:
            attn_plan = self.backend.plan(meta)
        if self.staging is not None:
            return attn_plan, self.staging.views["input_ids"]
        # through numpy: a third of torch.tensor's cost on a list of ints
        return attn_plan, torch.from_numpy(np.fromiter(input_ids, np.int64, len(input_ids)))

    # -- the forward
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_plan: Any
    ) -> torch.Tensor:
        """The model's forward with this engine's KV cache and backend bound:
        `(input_ids, positions, attn_plan) -> hidden [num_tokens, hidden]`."""
        return self.model_forward.forward(
            input_ids, positions, self.kv_cache.layers, self.backend, attn_plan
        )

    def run_model(self, batch: StepBatch) -> torch.Tensor:
        """Hidden states of one step. The one place a step's forward runs: the
        graph runner's, when graphs were asked for (it replays decode steps and
        runs the rest eagerly), else the plain forward."""
        if self.graphs is None:
            return self.forward(batch.input_ids, batch.meta.positions, batch.attn_plan)
        return self.graphs.run(batch.input_ids, batch.meta, batch.attn_plan)

    def wrap_device_work(self, wrap: Callable[[Callable], Callable]) -> None:
        """`Executor.wrap_device_work`: the forward, the LM head and the greedy argmax,
        replaced on this instance (the runner's own calls go through the wrappers)."""
        self.run_model = wrap(self.run_model)  # type: ignore[method-assign]
        self.logits = wrap(self.logits)  # type: ignore[method-assign]
        self.model_forward.argmax = wrap(self.model_forward.argmax)

    # -- tokens
    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The LM head on the sampling rows: [N, hidden] -> [N, vocab]."""
        return self.model_forward.logits(rows)

    def sample(self, hidden: torch.Tensor, batch: StepBatch) -> SampledTokens:
        """The step's tokens: one per sampling sequence, or n for a prompt that
        forks now, in `sample_owners` order (a decode batch's rows first)."""
        if not batch.sample_rows:
            return SampledTokens([], [])
        indices = batch.meta.logits_indices
        # one query token per sequence and every one sampling: the rows are in order already
        every_row = batch.meta.max_query_len == 1 and len(indices) == hidden.shape[0]
        rows = hidden if every_row else hidden[indices]
        logits = self.logits(rows)
        if len(batch.sample_rows) != logits.shape[0]:
            logits = logits[torch.tensor(batch.sample_rows, device=logits.device)]
        failed: dict = {}
        grammar_mask = None
        if batch.all_greedy:
            # ties go to the lowest index, as the sampler's greedy rule
            tokens = self.model_forward.argmax(logits).tolist()
        else:
            keep_probs = self.sampler.keep_probs  # a draft model's sampler keeps them always
            self.sampler.keep_probs = keep_probs or bool(batch.rejection)
            # an error in one request's rows fails that request only (its rows stand-ins)
            tokens, failed = sample_isolating_rows(
                self.sampler,
                logits,
                batch.sample_params,
                batch.sample_positions,
                self.generator,
                batch.sample_indices,
                batch.sample_seqs,
                logits_writable=self.logprobs_k < 0,  # the raw logits serve logprobs only
            )
            self.sampler.keep_probs = keep_probs
            if self.sampler.masked_rows:  # structured outputs: what the masks cost
                grammar_mask = (self.sampler.masked_rows, self.sampler.mask_seconds)
            if batch.rejection and self.sampler.last_probs is not None:
                verify_by_rejection(self.sampler.last_probs, tokens, batch.rejection,
                                    batch.sample_params, batch.sample_positions,
                                    batch.sample_indices, self.sampler, self.generator)  # fmt: skip
                self.sampler.last_probs = None
        owners = batch.sample_owners
        failed_owners = {owners[row]: exc for row, exc in failed.items()}
        if batch.verify:  # each row with drafts keeps a prefix of its samples
            kept = kept_rows(tokens, batch.verify)
            tokens, owners = [tokens[i] for i in kept], [owners[i] for i in kept]
            logits = logits[torch.tensor(kept, device=logits.device)]
        sampled = SampledTokens(owners, tokens)
        if batch.verify:
            sampled.runs = frozenset(batch.sample_owners[first] for first, _ in batch.verify)
        if failed_owners:
            sampled.failed = failed_owners
        if grammar_mask is not None:
            sampled.grammar_mask = grammar_mask
        if self.logprobs_k >= 0:  # only while a live request asked for logprobs
            sampled.logprobs = token_logprobs(logits, tokens, self.logprobs_k)
        return sampled

    def record_prompt_logprobs(self, hidden: torch.Tensor, batch: StepBatch) -> None:
        """Appends the step's prompt logprobs to the sequences that asked for them (from
        the raw logits, as the sampled tokens' logprobs), a few hundred rows at a time
        (a long prompt's [rows, vocab] logits at once could be gigabytes)."""
        rows, targets, owners = [], [], []
        for seq, row, first, last in batch.prompt_rows or ():
            rows += range(row, row + last - first + 1)
            targets += seq.token_ids[first : last + 1]
            owners += [seq] * (last - first + 1)
        k = max(seq.params.prompt_logprobs for seq in owners)
        index = torch.tensor(rows, device=hidden.device)
        for at in range(0, len(rows), PROMPT_ROWS_AT_ONCE):
            part = slice(at, at + PROMPT_ROWS_AT_ONCE)
            entries = token_logprobs(self.logits(hidden[index[part]]), targets[part], k)
            for seq, entry in zip(owners[part], entries):
                entry["top"] = entry["top"][: seq.params.prompt_logprobs]
                seq.prompt_logprobs.append(entry)

    def execute(self, plan: StepPlan) -> SampledTokens:
        """prepare, run_model, sample: one step's sampled tokens."""
        self.logprobs_k = plan.logprobs_k
        batch = self.prepare(plan)
        hidden = self.run_model(batch)
        if batch.prompt_rows:
            self.record_prompt_logprobs(hidden, batch)
        sampled = self.sample(hidden, batch)
        if plan.wants_hidden:  # a proposer reads them (speculative decoding)
            sampled.hidden = rows_hidden(plan, hidden)
        return sampled


PROMPT_ROWS_AT_ONCE = 256


def rows_hidden(plan: StepPlan, hidden: torch.Tensor) -> dict[int, tuple[int, torch.Tensor]]:
    """Each row's final hidden states, by sequence: (its first position, [count, hidden])."""
    out = {}
    at = 0
    for seq, start, count, _ in plan.rows():
        out[seq.seq_id] = (start, hidden[at : at + count])
        at += count
    return out


def _sample_rows(plan: StepPlan, verify: list | None = None, rejection: list | None = None
                 ) -> tuple:  # fmt: skip
    """`StepBatch`'s sampling fields: one sample per sampling row, or n for a
    prompt that forks now; greedy steps skip the per-row lists. Decode rows never
    fork: one sample each, in row order. A row with d drafts (`verify` collects
    it) samples at each of its d + 1 logits rows, the j-th at output position +j,
    its logits processed over the tokens and the drafts before it
    (`servelab.step.verify`); such a row decodes, so it never forks. A sampled
    row whose drafts carry probabilities also goes to `rejection`."""
    if plan.all_greedy and len(plan.seqs) == plan.num_decodes:
        return range(len(plan.seqs)), [], [], [], plan.seq_ids, True, None
    rows: list[int] = []
    params: list[SamplingParams] = []
    positions: list[int] = []
    indices: list[int] = []
    owners: list[int] = []
    seqs: list = []
    drafts = plan.draft_counts.tolist() if plan.draft_counts is not None else None
    hidden_row = 0  # the row of the logits each sample reads
    for row, (seq, _, _, samples) in enumerate(plan.rows()):
        if not samples:
            continue
        p = seq.params
        num_outputs = len(seq.token_ids) - seq.num_prompt_tokens
        drafted = drafts[row] if drafts is not None else 0
        if drafted:
            assert verify is not None  # a plan with drafts collects its verify groups
            verify.append((len(rows), seq.draft_tokens[:drafted]))
            if seq.draft_probs is not None and not p.greedy:
                assert rejection is not None
                rejection.append((len(rows), seq.draft_tokens[:drafted],
                                  seq.draft_probs[:drafted]))  # fmt: skip
            for j in range(drafted + 1):
                rows.append(hidden_row + j)
                params.append(p)
                positions.append(num_outputs + j)
                indices.append(seq.sample_index)
                owners.append(seq.seq_id)
                drafted_before = j and p.processes_logits
                seqs.append(DraftedHistory(seq, seq.draft_tokens[:j]) if drafted_before else seq)
            hidden_row += drafted + 1
            continue
        forks = p.n if num_outputs == 0 and p.n > 1 and seq.group.needs_fork else 1
        for k in range(forks):
            rows.append(hidden_row)
            params.append(p)
            positions.append(num_outputs)
            indices.append(k if forks > 1 else seq.sample_index)
            owners.append(seq.seq_id)
            seqs.append(seq)
        hidden_row += 1
    if plan.all_greedy:
        return rows, [], [], [], owners, True, None
    return rows, params, positions, indices, owners, False, seqs


def _prompt_rows(plan: StepPlan) -> list | None:
    """(seq, hidden row, first, last) of the rows that score prompt tokens (decode
    rows are past their prompts: none of them)."""
    found = None
    if plan.num_decodes == len(plan.seqs):
        return found
    num_rows = int(plan.counts[: plan.num_decodes].sum())
    for seq, start, count, _ in plan.rows(plan.num_decodes):
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
            found = _score_prompt(found, seq, start, count, num_rows)
        num_rows += count
    return found


def _score_prompt(found: list | None, seq, start: int, count: int, row: int) -> list:
    """Adds the rows of a chunk [start, start + count) that score prompt tokens not
    scored yet (hidden state j scores token j + 1); a gap (positions the step does not
    compute) is scored None, so the entries stay one per prompt token."""
    scored = seq.prompt_logprobs
    first = max(start + 1, len(scored))
    last = min(start + count, seq.num_prompt_tokens - 1)
    scored += [None] * (min(first, seq.num_prompt_tokens) - len(scored))
    found = found if found is not None else []
    if first <= last:
        found.append((seq, row + first - 1 - start, first, last))
    return found


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[dict]:
    """Per row: the sampled token's log-probability and the top `k` alternatives,
    in float32 from the logits the sampler read (before temperature)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    top_values, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    rows = []
    for i, token in enumerate(tokens):
        top = list(zip(top_ids[i].tolist(), top_values[i].tolist())) if k > 0 else []
        rows.append({"token_id": token, "logprob": float(chosen[i]), "top": top})
    return rows
