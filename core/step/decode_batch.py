"""`DecodeBatch`: the running sequences of a steady decode phase, kept between steps.

While every running sequence decodes, a step moves each by one token, and re-deriving it
from every sequence's lists costs Python work per sequence that, at a few hundred sequences,
outweighs a small model's CPU forward. The batch keeps positions, block tables and stop
limits as arrays and advances them with a few numpy operations. The scheduler builds one when
all running sequences decode, shrinks it as rows finish, grows it as prefills complete and
drops it on anything else (preemption, fork, abort, swap). `check` asserts the invariants:
`starts[i] == seqs[i].num_computed_tokens`, and `tables[i]` is `seqs[i]`'s block table.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from servelab.step.metadata import AttentionMetadata
from servelab.step.sequence import Sequence

SCALAR_ROWS = 32  # rows up to which a per-step lookup is cheaper in Python than in numpy


class DecodeBatch:
    """Rows = sequences that each compute their last token and sample the next."""

    def __init__(
        self,
        seqs: list[Sequence],
        block_tables: list[list[int]],
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.seqs: list[Sequence] = []
        self.seq_ids: list[int] = []
        self.starts = np.zeros(0, dtype=np.int64)
        self.stop_at = np.zeros(0, dtype=np.int64)  # finish (length) when num_tokens reaches it
        self.prompt_lens = np.zeros(0, dtype=np.int64)
        self.tables = np.zeros((0, self.max_blocks), dtype=np.int32)
        self.table_lens = np.zeros(0, dtype=np.int64)
        self.with_stop_tokens: set[int] = set()  # rows' seq ids that have stop token ids
        self.stop_tokens: frozenset[int] = frozenset()  # the union of their stop tokens
        self.all_greedy = True  # every row plain argmax (greedy, no logits processing)
        self.next_input: list[int] = []  # each row's last token: the step's input id
        self._arange_cache: dict[int, tuple] = {}  # see _aranges
        self._written: tuple | None = None  # see written_blocks
        # advances before a row can reach its length (min of stop_at - starts - 1), or
        # None when rows joined or left since it was counted: see advance
        self._steps_to_length: int | None = None
        self.append(seqs, block_tables)

    def __len__(self) -> int:
        return len(self.seqs)

    # -- membership
    def append(self, seqs: list[Sequence], block_tables: list[list[int]]) -> None:
        """Adds decoding sequences (each with its current block table) as new rows."""
        if not seqs:
            return
        # new lists, never extended in place: a step's plan keeps the old ones
        self.seqs = self.seqs + seqs
        self.seq_ids = self.seq_ids + [s.seq_id for s in seqs]
        self.next_input = self.next_input + [s.token_ids[-1] for s in seqs]
        self.starts = np.concatenate(
            [self.starts, np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))]
        )
        stop_at = [min(s.num_prompt_tokens + s.params.max_tokens, self.max_model_len) for s in seqs]
        self.stop_at = np.concatenate([self.stop_at, np.asarray(stop_at, dtype=np.int64)])
        prompt_lens = np.fromiter((s.num_prompt_tokens for s in seqs), np.int64, len(seqs))
        self.prompt_lens = np.concatenate([self.prompt_lens, prompt_lens])
        rows = np.zeros((len(seqs), self.max_blocks), dtype=np.int32)
        lens = np.fromiter(map(len, block_tables), np.int64, len(seqs))
        rows[np.arange(self.max_blocks) < lens[:, None]] = np.fromiter(
            (b for t in block_tables for b in t), np.int32, int(lens.sum())
        )
        self.tables = np.concatenate([self.tables, rows])
        self.table_lens = np.concatenate([self.table_lens, lens])
        self._steps_to_length = None
        self._note_stop_rules(seqs)

    def _note_stop_rules(self, seqs: list[Sequence]) -> None:
        stops = set(self.stop_tokens)
        for seq in seqs:
            params = seq.params
            tokens = set(params.stop_token_ids)
            if not params.ignore_eos:
                tokens |= seq.eos_token_ids
            if tokens:
                self.with_stop_tokens.add(seq.seq_id)
                stops |= tokens
            if not params.greedy or params.processes_logits:
                self.all_greedy = False
        self.stop_tokens = frozenset(stops)

    def keep(self, mask: np.ndarray) -> None:
        """Keeps the rows where `mask` is true (finished rows leave)."""
        rows = np.flatnonzero(mask).tolist()
        self.seqs = [self.seqs[r] for r in rows]
        self.seq_ids = [self.seq_ids[r] for r in rows]
        self.next_input = [self.next_input[r] for r in rows]
        self.starts = self.starts[mask]
        self.stop_at = self.stop_at[mask]
        self.prompt_lens = self.prompt_lens[mask]
        self.tables = self.tables[mask]
        self.table_lens = self.table_lens[mask]
        self._steps_to_length = None
        self.with_stop_tokens &= set(self.seq_ids)
        self.all_greedy = all(s.params.greedy and not s.params.processes_logits for s in self.seqs)

    # -- one step
    def rows_needing_block(self) -> np.ndarray:
        """Rows whose next token starts a new block."""
        return np.flatnonzero(self.starts >= self.table_lens * self.block_size)

    def add_blocks(self, rows: list[int], blocks: list[int]) -> None:
        """Row `rows[i]`'s table gained block `blocks[i]` at its end."""
        if rows:
            index = np.asarray(rows, dtype=np.int64)
            self.tables[index, self.table_lens[index]] = blocks
            self.table_lens[index] += 1

    def metadata(self, starts: np.ndarray, device: torch.device, staging=None) -> AttentionMetadata:
        """The attention inputs of a step of only this batch's decodes, computing
        the tokens at `starts` (the step's snapshot of `self.starts`); on a
        device, uploaded through `staging` when given (`AttentionMetadata.to_device`)."""
        # every numpy call here runs once per step, cache-cold after the forward
        # streamed the K/V through: as few as possible (microseconds each)
        n = len(starts)
        bs = self.block_size
        rows, query_start, logits_indices = self._aranges(n)
        context_lens = starts.astype(np.int32)
        seq_lens = context_lens + 1
        width = max(1, int(self.table_lens.max())) if n else 1
        tables = self.tables[:, :width].copy()  # the batch's array changes next step
        block_index, offset = np.divmod(starts, bs)
        blocks = tables[rows, block_index]
        self._written = (starts, blocks, offset)  # `written_blocks` of this step reuses them
        slots = blocks * np.int64(bs) + offset
        seq_start = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(seq_lens, out=seq_start[1:])
        tensors = dict(
            query_start_loc=query_start,
            seq_start_loc=torch.from_numpy(seq_start),
            seq_lens=torch.from_numpy(seq_lens),
            context_lens=torch.from_numpy(context_lens),
            block_tables=torch.from_numpy(tables),
            slot_mapping=torch.from_numpy(slots),
            positions=torch.from_numpy(starts),  # the plan's own snapshot: never changed
            logits_indices=logits_indices,
        )
        if device.type != "cpu" or staging is not None:
            tensors = AttentionMetadata.to_device(tensors, device, staging)
        seq_lens_list = seq_lens.tolist()
        return AttentionMetadata(
            num_seqs=n,
            num_one_query_seqs=n,
            num_tokens=n,
            block_size=bs,
            query_lens_cpu=[1] * n,
            seq_lens_cpu=seq_lens_list,
            # a lazy list: a row is built when read
            block_tables_cpu=cast("list[list[int]]", LazyTables(tables, self.table_lens.copy())),
            max_query_len=1 if n else 0,
            max_seq_len=max(seq_lens_list) if n else 0,
            **tensors,
        )

    def _aranges(self, n: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """0..n-1 (numpy int64), 0..n (int32 tensor: query starts) and 0..n-1
        (int64 tensor: logits rows), built once per batch size; read-only."""
        found = self._arange_cache.get(n)
        if found is None:
            found = (
                np.arange(n, dtype=np.int64),
                torch.arange(n + 1, dtype=torch.int32),
                torch.arange(n, dtype=torch.int64),
            )
            self._arange_cache[n] = found
        return found

    def written_blocks(self, starts: np.ndarray) -> tuple[list[int], list[int]]:
        """For the step that computed the tokens at `starts`: the block each row
        wrote its token into, and the rows whose token filled that block (from
        `metadata`'s arrays when it built this step's)."""
        cached = self._written
        if cached is not None and cached[0] is starts:
            _, blocks, offset = cached
        elif len(starts) <= SCALAR_ROWS:  # a few rows: Python ints beat numpy's per-call cost
            bs, item = self.block_size, self.tables.item
            written, filled = [], []
            for row, start in enumerate(starts.tolist()):
                index, within = divmod(start, bs)
                written.append(item(row, index))
                if within == bs - 1:
                    filled.append(row)
            return written, filled
        else:
            index, offset = np.divmod(starts, self.block_size)
            blocks = self.tables[self._aranges(len(starts))[0], index]
        return blocks.tolist(), np.flatnonzero(offset == self.block_size - 1).tolist()

    def advance(self, tokens: list[int], now: float) -> list[tuple[int, Sequence]]:
        """Appends each row's sampled token (`tokens` in row order), advances the
        counters, and returns the rows (index, sequence) that may have to stop:
        every one that must is among them (length by arrays; a stop token by the
        union of the rows' stop tokens, so the caller applies each sequence's own
        rule). Rows do not leave here (`keep` does)."""
        for seq, token in zip(self.seqs, tokens):
            seq.num_computed_tokens += 1
            seq.token_ids.append(token)
            seq.token_times.append(now)
        self.starts += 1
        self.next_input = tokens
        # num_tokens is now starts + 1 (the new token has no K/V yet); a row is at its
        # length when stop_at - starts - 1 <= 0, and that gap shrinks by one a step for
        # every row: while its minimum is positive no row needs looking at
        left = self._steps_to_length
        left = None if left is None else left - 1
        if left is None or left <= 0:
            gaps = self.stop_at - self.starts - 1
            left = int(gaps.min()) if len(gaps) else None
            done = np.flatnonzero(gaps <= 0).tolist() if left is not None and left <= 0 else []
        else:
            done = []
        self._steps_to_length = left
        stopping = [(r, self.seqs[r]) for r in done]
        if self.with_stop_tokens:
            stops, with_stops, at_length = self.stop_tokens, self.with_stop_tokens, set(done)
            stopping += [
                (r, seq)
                for r, (seq, token) in enumerate(zip(self.seqs, tokens))
                if token in stops and seq.seq_id in with_stops and r not in at_length
            ]
        return stopping

    # -- checks
    def check(self, block_table) -> None:
        """Asserts the arrays mirror the sequences and the allocator's tables."""
        assert len(self.seqs) == len(self.starts) == len(self.tables) == len(self.table_lens)
        for i, seq in enumerate(self.seqs):
            assert seq.num_computed_tokens == self.starts[i], f"row {i}: stale position"
            assert seq.is_decoding, f"row {i}: its next step is no decode"
            table = block_table(seq)
            assert self.table_lens[i] == len(table), f"row {i}: stale table length"
            assert self.tables[i, : len(table)].tolist() == table, f"row {i}: stale block table"


class LazyTables:
    """`AttentionMetadata.block_tables_cpu` of a batch step: rows as lists, built
    only if something asks (no built-in backend does)."""

    def __init__(self, tables: np.ndarray, lens: np.ndarray) -> None:
        self._tables = tables
        self._lens = lens
        self._lists: list[list[int]] | None = None

    def _rows(self) -> list[list[int]]:
        if self._lists is None:
            rows = self._tables.tolist()
            self._lists = [row[:n] for row, n in zip(rows, self._lens.tolist())]
        return self._lists

    def __len__(self) -> int:
        return len(self._tables)

    def __getitem__(self, index):
        return self._rows()[index]

    def __iter__(self):
        return iter(self._rows())
