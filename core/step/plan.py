"""What one step runs, as the scheduler decided it: `StepPlan` (its rows,
decodes first, then prefill chunks), the allocator's `BlockCopies`, and after
the forward the `SampledTokens`; and `RunningRows`, the running sequences of
a steady decode phase kept as arrays between steps, which a plan takes as its
first rows at once. Torch-free: allocators import it.

A decode is a sequence whose step computes exactly one token past its prompt
(its last token, one it sampled earlier) and samples the next one
(`Sequence.is_decoding`: its next step would be one).
That is the only meaning of "decode" for the scheduler, the engine and the
metrics: a plan lists its decodes first, the model runner counts them for the
attention split, and a step's `decode_tokens` are its decodes. Every other
token a step computes is prefill work: a prompt chunk, or a recomputing
sequence computing again tokens it sampled before (even one at a time).
Attention sees only shapes: one query token per sequence is a one-query
sequence there (`AttentionMetadata.num_one_query_seqs`).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from servelab.step.sequence import Sequence


# one block's K/V ([2, layers, block_size, kv_heads, head_dim], on the CPU) to keep, and
# a kept block's K/V to load: what a KV tier's storage exchanges with the executor
BlockSink = Callable[[Any], None]
BlockSource = Callable[[], Any]


@dataclass
class BlockCopies:
    """Block copies an allocator asks for; the executor's `apply` runs them, in this
    order: a KV tier's stores (`tier_out`, `tier_save`: they read evicted device blocks
    before anything else may write them), swap-out (device -> host), a KV tier's loads
    (`tier_in`, `tier_fetch`), swap-in (host -> device), copy-on-write (device -> device).
    Within one list a later pair wins where two write the same block. The `tier_*`
    lists stay empty without a KV tier (`servelab.contracts.kv_tier`).
    """

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copy: list[tuple[int, int]] = field(
        default_factory=list
    )  # (src device block, dst device block)
    # a KV tier keeping an evicted prefix block in a host block of the swap pool, and back
    tier_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    tier_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # a KV tier's own storage (a disk): the executor hands a block's K/V to the sink, and
    # writes what the source returns into a block (`servelab.contracts.kv_tier`)
    tier_save: list[tuple[int, BlockSink]] = field(default_factory=list)
    tier_fetch: list[tuple[BlockSource, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.swap_out
            or self.swap_in
            or self.copy
            or self.tier_out
            or self.tier_in
            or self.tier_save
            or self.tier_fetch
        )

    @property
    def has_tier_copies(self) -> bool:
        return bool(self.tier_out or self.tier_in or self.tier_save or self.tier_fetch)

    def extend(self, other: BlockCopies) -> None:
        self.swap_out += other.swap_out
        self.swap_in += other.swap_in
        self.copy += other.copy
        self.tier_out += other.tier_out
        self.tier_in += other.tier_in
        self.tier_save += other.tier_save
        self.tier_fetch += other.tier_fetch


class StepPlan:
    """What the scheduler decided for one step, as rows: row i is sequence
    `seqs[i]` computing its tokens `[starts[i], starts[i] + counts[i])` into the
    blocks of its table (`tables[i, :table_lens[i]]`), and sampling the token
    after them when `samples[i]`. Its decodes come first (`num_decodes` rows):
    attention splits off the leading one-query rows with one index.

    While the scheduler plans, rows come one by one (`add`: a prompt chunk, a
    recompute, a decode planned on its own) or as the steady decode phase's
    rows at once (`add_rows`: arrays it keeps between steps); `close` builds
    the arrays once, so every reader (model runner, cost model, simulator,
    update, metrics) reads one representation, in array operations where the
    step is large.
    """

    def __init__(self, preempted: list[Sequence] | None = None) -> None:
        self.seqs: list[Sequence] = []
        self.seq_ids: list[int] = []
        self.starts = self.counts = self.table_lens = _EMPTY
        self.samples = _NO_SAMPLES
        self.tables = _NO_TABLES
        self.input_ids: list[int] = []  # the tokens the step computes, packed in row order
        # speculative decoding: each row's drafts (its tokens past the sequence's own,
        # verified at every position: `servelab.step.verify`); None when no row has any
        self.draft_counts: np.ndarray | None = None
        # the proposer reads the target's final hidden states: the executor returns
        # each row's (`SampledTokens.hidden`)
        self.wants_hidden = False
        self.num_decodes = 0
        # decode rows' stop limits (finish by length when num_tokens reaches it), and the
        # stop token ids any of them stops on (each row still applies its own rule)
        self.stop_at = _EMPTY
        self.stop_tokens: frozenset[int] = frozenset()
        self.all_greedy = True  # every sampling row takes the argmax (no sampling, no processing)
        # the decode rows' blocks their tokens go to and offsets in them (`close`); their
        # slots are `decode_slots`
        self.decode_blocks: np.ndarray = _EMPTY
        self.decode_offsets: np.ndarray = _EMPTY
        self._block_size = 1
        self._decode_slots: np.ndarray | None = None
        self.copies = BlockCopies()
        self.preempted: list[Sequence] = preempted if preempted is not None else []
        self.idle_slots = 0  # static batching: finished sequences still holding a slot
        # the most logprob alternatives a live request asked for (-1: none asked);
        # the engine sets it, the executor returns `SampledTokens.logprobs` when >= 0
        self.logprobs_k = -1
        # the rows planned one by one (every sequence's first step is among them)
        self.listed: list[Sequence] = []
        self._listed_rows: list[tuple[Sequence, int, int]] = []  # (seq, start, count)
        # the decode phase's rows (`add_rows`), when the plan took them: its first rows
        self.running_rows: RunningRows | None = None
        self._rows_starts = _EMPTY

    # -- while planning
    def add(self, seq: Sequence, count: int) -> None:
        """Plans `count` tokens of `seq` from its `num_computed_tokens`."""
        self.listed.append(seq)
        self._listed_rows.append((seq, seq.num_computed_tokens, count))

    def add_rows(self, rows: RunningRows, starts: np.ndarray) -> None:
        """Plans the decode phase's rows (`RunningRows`): each computes its last
        token, at `starts` (`rows.positions()`), and samples the next."""
        self.running_rows = rows
        self._rows_starts = starts

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self._listed_rows and self.running_rows is None

    def close(
        self, block_table: Callable[[Sequence], list[int]], block_size: int, max_model_len: int
    ) -> None:
        """Builds the rows' arrays, decodes first (each part in planning order)."""
        self._close_rows(block_table, max_model_len)
        # where each decode row writes its token: read by the metadata (its slot) and
        # by the update (the block it fills), computed once
        n = self.num_decodes
        block_index, self.decode_offsets = np.divmod(self.starts[:n], block_size)
        # a flat take: cheaper than a two-dimensional fancy index
        block_index += row_numbers(n) * self.tables.shape[1]
        self.decode_blocks = self.tables.ravel().take(block_index)
        self._block_size = block_size

    @property
    def decode_slots(self) -> np.ndarray:
        """Where each decode row's token goes (block x block_size + offset): the model
        runner's, built on first use (the simulated executor never asks)."""
        if self._decode_slots is None:
            slots = np.multiply(self.decode_blocks, self._block_size, dtype=np.int64)
            slots += self.decode_offsets
            self._decode_slots = slots
        return self._decode_slots

    def _close_rows(self, block_table: Callable[[Sequence], list[int]], max_model_len: int) -> None:
        bulk, listed = self.running_rows, self._listed_rows
        if bulk is not None and not listed:  # the steady decode phase: the rows' own arrays
            n = len(bulk)
            self.seqs, self.seq_ids = bulk.seqs, bulk.seq_ids
            self.input_ids = bulk.next_input
            self.starts = self._rows_starts
            self.counts = _ones(n)
            self.samples = _ones(n, bool)
            self.tables = bulk.used_tables().copy()
            self.table_lens = bulk.table_lens.copy()
            self.num_decodes = n
            self.stop_at, self.stop_tokens = bulk.stop_at, bulk.stop_tokens
            self.all_greedy = bulk.all_greedy
            return
        decodes = [r for r in listed if _is_decode(*r)]
        rows = decodes + [r for r in listed if not _is_decode(*r)] if decodes else listed
        seqs = [r[0] for r in rows]
        starts = np.fromiter((r[1] for r in rows), np.int64, len(rows))
        counts = np.fromiter((r[2] for r in rows), np.int64, len(rows))
        num_tokens = np.fromiter((s.num_tokens for s in seqs), np.int64, len(rows))
        table_lists = [block_table(s) for s in seqs]
        tables = block_table_array(table_lists)
        table_lens = np.fromiter(map(len, table_lists), np.int64, len(table_lists))
        stop_at = [_stop_at(s, max_model_len) for s, _, _ in decodes]
        stops = set().union(*(_stop_token_ids(s) for s, _, _ in decodes))
        self.all_greedy = all(_greedy(s) for s in seqs)
        if bulk is not None and len(bulk):
            seqs = bulk.seqs + seqs
            starts = np.concatenate([self._rows_starts, starts])
            counts = np.concatenate([_ones(len(bulk)), counts])
            num_tokens = np.concatenate([self._rows_starts + 1, num_tokens])
            tables = _stack_padded(bulk.used_tables(), tables)
            table_lens = np.concatenate([bulk.table_lens, table_lens])
            stop_at = bulk.stop_at.tolist() + stop_at
            stops |= bulk.stop_tokens
            self.all_greedy = self.all_greedy and bulk.all_greedy
        self.seqs = seqs
        self.seq_ids = [s.seq_id for s in seqs]
        self.starts, self.counts = starts, counts
        self.input_ids = bulk.next_input[:] if bulk is not None else []
        drafted = False
        for seq, start, count in rows:
            if count == 1:
                self.input_ids.append(seq.token_ids[start])
            else:
                self.input_ids += seq.token_ids[start : start + count]
                if start + count > len(seq.token_ids):  # a decode with drafts
                    self.input_ids += seq.draft_tokens[: start + count - len(seq.token_ids)]
                    drafted = True
        ends = starts + counts
        self.samples = ends >= num_tokens
        if drafted:
            self.draft_counts = np.maximum(ends - num_tokens, 0)
        self.tables, self.table_lens = tables, table_lens
        self.num_decodes = len(decodes) + (len(bulk) if bulk is not None else 0)
        self.stop_at = np.asarray(stop_at, dtype=np.int64)
        self.stop_tokens = frozenset(stops)

    # -- reading a closed plan
    def rows(self, first: int = 0) -> Iterator[tuple[Sequence, int, int, bool]]:
        """(sequence, start, count, samples) of each row from `first`."""
        if first >= len(self.seqs):  # e.g. the rows after a decode-only plan's decodes
            return iter(())
        return zip(
            self.seqs[first:],
            self.starts[first:].tolist(),
            self.counts[first:].tolist(),
            self.samples[first:].tolist(),
        )

    def step_counts(self) -> tuple[int, int, int]:
        """(sequences, decodes, sampling rows) of this step. A decode computes one
        token, so its decodes are also its decode tokens; every other token is prefill.
        Every decode samples: a decode-only plan's sampling rows are its rows."""
        n = len(self.seqs)
        return n, self.num_decodes, n if n == self.num_decodes else int(self.samples.sum())

    @property
    def num_tokens(self) -> int:
        if len(self.seqs) == self.num_decodes:  # a decode computes one token
            return self.num_decodes
        return int(self.counts.sum())

    def __repr__(self) -> str:
        return (
            f"StepPlan(rows={len(self.seqs)}, decodes={self.num_decodes}, "
            f"tokens={self.num_tokens}, preempted={len(self.preempted)}, "
            f"idle_slots={self.idle_slots})"
        )


_EMPTY = np.zeros(0, dtype=np.int64)
_COMPUTED = operator.attrgetter("num_computed_tokens")
_NO_SAMPLES = np.zeros(0, dtype=bool)
_NO_TABLES = np.zeros((0, 1), dtype=np.int32)
for _array in (_EMPTY, _NO_SAMPLES, _NO_TABLES):
    _array.flags.writeable = False
_ONES: dict[tuple[int, type], np.ndarray] = {}
_ROWS: dict[int, np.ndarray] = {}
FEW_ROWS = 8  # rows up to which per-row Python beats a handful of whole-array numpy calls


def row_numbers(n: int) -> np.ndarray:
    """0..n-1 (int64), read-only and built once per size: a step's row numbers."""
    found = _ROWS.get(n)
    if found is None:
        found = _ROWS[n] = np.arange(n, dtype=np.int64)
        found.flags.writeable = False
    return found


def _ones(n: int, dtype: type = np.int64) -> np.ndarray:
    """n ones (int64: every decode row's count; bool: every decode row samples),
    read-only and built once per size."""
    found = _ONES.get((n, dtype))
    if found is None:
        found = _ONES[(n, dtype)] = np.ones(n, dtype=dtype)
        found.flags.writeable = False
    return found


def _is_decode(seq: Sequence, start: int, count: int) -> bool:
    """One token past the prompt, and a sample after it: a decode (module docstring)."""
    return count == 1 and start + 1 == seq.num_tokens and start >= seq.num_prompt_tokens


def _greedy(seq: Sequence) -> bool:
    return seq.params.greedy and not seq.params.processes_logits


def _stop_token_ids(seq: Sequence) -> set[int]:
    """The token ids that stop `seq` (its stop tokens, and EOS unless ignored)."""
    tokens = set(seq.params.stop_token_ids)
    if not seq.params.ignore_eos:
        tokens |= seq.eos_token_ids
    return tokens


def _stop_at(seq: Sequence, max_model_len: int) -> int:
    """The length at which `seq` finishes (max_tokens, capped at max_model_len)."""
    return min(seq.num_prompt_tokens + seq.params.max_tokens, max_model_len)


def _stack_padded(top: np.ndarray, bottom: np.ndarray) -> np.ndarray:
    """Two block-table arrays as one, the narrower padded with 0."""
    width = max(top.shape[1], bottom.shape[1])
    out = np.zeros((len(top) + len(bottom), width), dtype=np.int32)
    out[: len(top), : top.shape[1]] = top
    out[len(top) :, : bottom.shape[1]] = bottom
    return out


def block_table_array(block_tables: list[list[int]], width: int | None = None) -> np.ndarray:
    """Ragged block tables as one int32 `[num_seqs, width]` array (by default the
    longest table's length, at least one column), padded with 0, in three numpy
    calls whatever the batch."""
    num_seqs = len(block_tables)
    if num_seqs <= FEW_ROWS:  # a few tables (a prompt joining): one slice each is cheaper
        longest = max(map(len, block_tables), default=0)
        array = np.zeros((num_seqs, max(longest, 1) if width is None else width), dtype=np.int32)
        for row, table in enumerate(block_tables):
            array[row, : len(table)] = table
        return array
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_seqs)
    longest = int(lens.max()) if num_seqs else 0
    array = np.zeros((num_seqs, max(longest, 1) if width is None else width), dtype=np.int32)
    if longest:
        total = int(lens.sum())
        flat = np.fromiter(itertools.chain.from_iterable(block_tables), np.int32, count=total)
        # a row-major boolean mask assigns row by row, each row's blocks in order
        array[np.arange(array.shape[1]) < lens[:, None]] = flat
    return array


class RunningRows:
    """The running sequences of a steady decode phase, kept between steps: rows
    that each compute their last token and sample the next.

    While every running sequence decodes, a step moves each by one token, and
    re-deriving that from every sequence's lists costs Python work per sequence
    that, at a few hundred sequences, outweighs a small model's CPU forward. The
    rows keep block tables, stop limits and last tokens as arrays, changed with a
    few numpy operations a step. The scheduler builds them when all running
    sequences decode, shrinks them as rows finish, grows them as prefills
    complete and drops them on anything else (preemption, fork, abort, swap).
    `check` asserts the invariants: every row decodes, and `tables[i]` is
    `seqs[i]`'s block table. A row's position is its sequence's own
    (`positions` reads them): the rows keep what the sequences do not hold as
    arrays."""

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
        stop_at = [_stop_at(s, self.max_model_len) for s in seqs]
        self.stop_at = np.concatenate([self.stop_at, np.asarray(stop_at, dtype=np.int64)])
        rows = block_table_array(block_tables, self.max_blocks)
        lens = np.fromiter(map(len, block_tables), np.int64, len(seqs))
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
        self.stop_at = self.stop_at[mask]
        self.tables = self.tables[mask]
        self.table_lens = self.table_lens[mask]
        if not self.all_greedy:  # the rows left may all be greedy now (a subset of greedy is)
            self.all_greedy = all(map(_greedy, self.seqs))

    # -- one step
    def used_tables(self) -> np.ndarray:
        """A view of the tables' columns some row uses (at least one); the rows
        change it in place next step, so a plan copies what it keeps."""
        width = max(1, int(self.table_lens.max())) if len(self.seqs) else 1
        return self.tables[:, :width]

    def positions(self) -> np.ndarray:
        """Each row's position: the token it computes next (its sequence's
        `num_computed_tokens`), read in one pass."""
        return np.fromiter(map(_COMPUTED, self.seqs), np.int64, len(self.seqs))

    def rows_needing_block(self, starts: np.ndarray) -> np.ndarray:
        """Rows whose next token (at `starts`) starts a new block."""
        return (starts >= self.table_lens * self.block_size).nonzero()[0]

    def add_blocks(self, rows: list[int], blocks: list[int]) -> None:
        """Row `rows[i]`'s table gained block `blocks[i]` at its end."""
        if len(rows) <= FEW_ROWS:  # most steps: none or a row or two
            tables, lens = self.tables, self.table_lens
            for row, block in zip(rows, blocks):
                end = lens[row]
                tables[row, end] = block
                lens[row] = end + 1
        else:
            index = np.asarray(rows, dtype=np.int64)
            self.tables[index, self.table_lens[index]] = blocks
            self.table_lens[index] += 1

    def advanced(self, tokens: list[int]) -> None:
        """Every row computed its last token and got `tokens` (row order) appended."""
        self.next_input = tokens

    # -- checks
    def check(self, block_table) -> None:
        """Asserts the arrays mirror the sequences and the allocator's tables."""
        assert len(self.seqs) == len(self.next_input) == len(self.tables) == len(self.table_lens)
        for i, seq in enumerate(self.seqs):
            assert self.next_input[i] == seq.token_ids[-1], f"row {i}: stale last token"
            assert seq.is_decoding, f"row {i}: its next step is no decode"
            table = block_table(seq)
            assert self.table_lens[i] == len(table), f"row {i}: stale table length"
            assert self.tables[i, : len(table)].tolist() == table, f"row {i}: stale block table"


class SampledTokens:
    """The tokens one step sampled: `tokens[i]` belongs to sequence `owners[i]`
    (a prompt that forks now owns n consecutive entries). A plan's decode-batch
    rows come first, one token each, in row order, so `update` reads them by
    position; `get` looks a sequence's tokens up by id (an index built on first
    use). The one type every executor returns and the scheduler and engine read:
    not a mapping, so a plain dict never passes for it."""

    def __init__(self, owners: list[int], tokens: list[int]) -> None:
        self.owners = owners
        self.tokens = tokens
        self.logprobs: list[dict] | None = None  # per entry, when a request asked for them
        # seq_id -> its error, for the sequences whose own sampling raised: their entries
        # are stand-ins, and the engine fails their requests (the others' tokens are exact)
        self.failed: dict[int, Exception] = {}
        # the owners whose several entries are one sequence's tokens (a decode whose
        # drafts were kept: `servelab.step.verify`), not a prompt forking now
        self.runs: frozenset[int] = frozenset()
        # when the plan `wants_hidden`: seq_id -> (first position, the final hidden
        # states [count, hidden] of the positions its row computed)
        self.hidden: dict[int, tuple[int, Any]] | None = None
        # structured outputs: (rows masked, seconds the masks took) when any row was
        self.grammar_mask: tuple[int, float] | None = None
        self._by_seq: dict[int, list[int]] | None = None
        self._indexed_from = 0  # the first entry `_by_seq` indexes

    def get(self, seq_id: int, first: int = 0) -> list[int] | None:
        """The tokens sampled for `seq_id` (n for a prompt that forked), None if none;
        `first`: the entries before it belong to other sequences (a plan's decode rows,
        which come first), so only the later ones need indexing (an index from an
        earlier entry answers the same)."""
        if self._by_seq is None or self._indexed_from > first:
            self._indexed_from = first
            by_seq: dict[int, list[int]] = {}
            owners, tokens = self.owners, self.tokens
            if first:
                owners, tokens = owners[first:], tokens[first:]
            for owner, token in zip(owners, tokens):
                if owner in by_seq:
                    by_seq[owner].append(token)
                else:
                    by_seq[owner] = [token]
            self._by_seq = by_seq
        return self._by_seq.get(seq_id)
