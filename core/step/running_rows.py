"""`RunningRows`: the running sequences of a steady decode phase, kept between steps.

While every running sequence decodes, a step moves each by one token, and re-deriving it
from every sequence's lists costs Python work per sequence that, at a few hundred sequences,
outweighs a small model's CPU forward. The rows keep positions, block tables and stop
limits as arrays and advance them with a few numpy operations; a plan takes them as its
decode rows at once (`StepPlan.add_rows`). The scheduler's decode phase builds them when
all running sequences decode, shrinks them as rows finish, grows them as prefills complete
and drops them on anything else (preemption, fork, abort, swap). `check` asserts the
invariants: `starts[i] == seqs[i].num_computed_tokens`, and `tables[i]` is `seqs[i]`'s
block table.
"""

from __future__ import annotations

import numpy as np

from servelab.step.plan import _greedy, _stop_at, _stop_token_ids
from servelab.step.sequence import Sequence


class RunningRows:
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
        self.tables = np.zeros((0, self.max_blocks), dtype=np.int32)
        self.table_lens = np.zeros(0, dtype=np.int64)
        self.stop_tokens: frozenset[int] = frozenset()  # the union of the rows' stop tokens
        self.all_greedy = True  # every row plain argmax (greedy, no logits processing)
        self.next_input: list[int] = []  # each row's last token: the step's input id
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
        stop_at = [_stop_at(s, self.max_model_len) for s in seqs]
        self.stop_at = np.concatenate([self.stop_at, np.asarray(stop_at, dtype=np.int64)])
        rows = np.zeros((len(seqs), self.max_blocks), dtype=np.int32)
        lens = np.fromiter(map(len, block_tables), np.int64, len(seqs))
        rows[np.arange(self.max_blocks) < lens[:, None]] = np.fromiter(
            (b for t in block_tables for b in t), np.int32, int(lens.sum())
        )
        self.tables = np.concatenate([self.tables, rows])
        self.table_lens = np.concatenate([self.table_lens, lens])
        self._note_stop_rules(seqs)

    def _note_stop_rules(self, seqs: list[Sequence]) -> None:
        stops = set(self.stop_tokens)
        for seq in seqs:
            stops |= _stop_token_ids(seq)
        self.all_greedy = self.all_greedy and all(map(_greedy, seqs))
        self.stop_tokens = frozenset(stops)

    def keep(self, mask: np.ndarray) -> None:
        """Keeps the rows where `mask` is true (finished rows leave)."""
        rows = np.flatnonzero(mask).tolist()
        self.seqs = [self.seqs[r] for r in rows]
        self.seq_ids = [self.seq_ids[r] for r in rows]
        self.next_input = [self.next_input[r] for r in rows]
        self.starts = self.starts[mask]
        self.stop_at = self.stop_at[mask]
        self.tables = self.tables[mask]
        self.table_lens = self.table_lens[mask]
        self.all_greedy = all(map(_greedy, self.seqs))

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

    def advanced(self, tokens: list[int]) -> None:
        """Every row computed its last token and got `tokens` (row order) appended."""
        self.starts += 1
        self.next_input = tokens

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

