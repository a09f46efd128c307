"""The simulated executor's cost of one step, from the plan alone.

Every operation is `Op(flops, bytes, launches, rows, call)` and costs
    time = max(flops / (peak FLOP/s x efficiency x curve(rows)),
               bytes x wave(rows) / (peak bandwidth x efficiency))
           + launches x launch_overhead + the fixed cost of its call,
where curve(rows) = rows / (rows + half_rows) is the efficiency curve of the op's class
(matmul: rows = the tokens it multiplies, attention: its query rows): a small op cannot
fill the machine, and reaches half its class's efficiency at `half_rows` rows
(`matmul_half_rows`, `attention_half_rows`; 0 turns the curve off). Element-wise ops
have their own bandwidth efficiency (`elementwise_efficiency`, or one per kernel in
`kernel_efficiency`: an RMSNorm reaches a third of a residual add's bandwidth on
GPUs) and size curve: a kernel runs one block per row, so fewer rows than
`elementwise_full_rows` (a wave of the device's cores) cost as many:
wave(rows) = max(rows, full_rows) / rows (1 for other classes). Matmuls and attention calls carry a
fixed cost apiece (`matmul_overhead`, `attention_prefill_overhead`,
`attention_decode_overhead`): setup and the last partial wave, microseconds on GPUs.
Per GPU, with tensor parallelism p (heads, the intermediate size and the vocabulary
split p ways; T tokens in the step, e bytes per element, h hidden, H/K query/KV
heads of size d, I intermediate, V vocabulary, L layers, S sampling rows):
- projections, per layer: y[T, n] = x[T, m] W[m, n]; flops 2 T m n, bytes
  e (m n + T m + T n); qkv (m = h, n = (H + 2K) d / p) and gate_up (h, 2I/p) split
  columns, o (H d / p, h) and down (I/p, h) split rows;
- attention, per layer: a query at position j attends over j + 1 keys, 4 d flops
  each (QK and PV), so a chunk of q tokens after s cached ones costs
  4 d H/p (q s + q (q + 1) / 2); bytes read K/V of every key, write this step's K/V
  and read Q / write O: e d (2 K/p keys + 2 K/p q + 2 H/p q). Prefill chunks and
  decodes are separate ops; a decode row with d drafts (speculative decoding's
  verification) is a decode of q = d + 1 query tokens, priced by the same formulas
  in the decode op (one block per query head and sequence, its keys read once);
  the padded backend computes every sequence at the longest query and key length:
  one op of n x max_q x max_k;
- attention's kernel blocks, per layer: a block is one query head of one sequence's tile
  of up to 128 query rows (a decode: one row) and streams the K/V of every key its rows
  attend to (e d 2 per key) from memory or L2; with `attention_gqa_packing` a decode's
  block is one KV head of one sequence instead, its query heads packed into the block's
  rows, so each KV head is streamed once (1: in steps of one-query decodes alone, as
  vLLM's FlashAttention 2 swaps a one-token query's heads into rows; 2: in every step,
  as FlashAttention 3 packs them); `attention_wave_blocks` blocks run at once (about the
  device's cores x the blocks each holds): a packed call of fewer splits each block's
  keys (in tiles of 128 keys at least) until it has that many (split-KV decoding); the
  op costs at least each of
  streamed bytes / (peak bandwidth x `attention_stream_efficiency`), the longest
  block's keys x `attention_key_time` (a block runs on one SM: one long sequence cannot
  use the device; with `attention_wave_blocks`, times the waves: blocks / wave blocks
  when more) and blocks x `attention_block_overhead` (each figure 0: off);
- element-wise, per layer, bytes only: two RMSNorms (read + write h), two residual
  adds (read 2h, write h), RoPE on q and k (read + write), SiLU x up (read 2I/p,
  write I/p); six launches. Their data is what the kernel before wrote, so it is read
  from L2 where it fits (the kernel efficiencies may exceed 1); with `l2_bytes` set, the
  bytes beyond it come from DRAM at `bandwidth_efficiency`; with `l2_reuse_bytes` set,
  the residual each fused add + RMSNorm reads, written before a block's weights and
  activations passed through L2, comes from DRAM as far as they overflow that L2
  (`residual_rereads`, `evicted`);
- all-reduce, two per layer when p > 1 (after o and down), ring, of a message of
  b = e T h bytes: latency + latency_per_device x (p - 1)
  + 2 (p - 1) / p x b / (interconnect bandwidth x curve(b)),
  curve(b) = (b / (b + interconnect_half_bytes)) ** interconnect_curve_exponent: small
  messages do not fill the links;
- once per step: the embedding gather (e T h), the final norm and LM head on the
  sampling rows (flops 2 S h V/p; a row with d drafts samples d + 1 of them),
  reading their logits to sample; when p > 1
  also the vocabulary-parallel embedding's all-reduce and the gather of the
  logits' chunks to rank 0: latency + (p - 1) / p x e S V / interconnect bandwidth;
- host: step_overhead + seq_overhead x sequences, or a host profile's figures
  (`servelab.executor.host_profile`: the engine's own CPU time, measured).
Block copies: swap bytes over the host link, copy-on-write reads and writes
each block in device memory, each share split over the p devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from servelab.executor.hardware import HardwareProfile
from servelab.executor.host_profile import HostProfile

# efficiency classes
MATMUL, ATTENTION, MEMORY, ELEMENTWISE = "matmul", "attention", "memory", "elementwise"
# calls with a fixed cost apiece: matmuls (setup, the last partial wave), attention
PREFILL, DECODE = "prefill", "decode"
BLOCK_ROWS = 128  # query rows per attention kernel block (FlashAttention's tile)
PAGED_ROWS = 64  # query rows per block of vLLM's paged FlashAttention 2 (its split-KV kernel)
CACHE_SIZE = 1 << 16  # token counts (and sampling rows) whose step pieces are kept priced
PRICED_MODELS = 16  # cost models (shape, profile, dtype, tp) whose priced pieces are kept
_EMPTY = np.zeros(0)
_EMPTY.flags.writeable = False
# (shape, profile, dtype, bytes per element, tp) -> the step pieces priced so far
_PRICED: dict[tuple, tuple[dict[int, tuple], dict[tuple[int, int], float]]] = {}


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # MATMUL | ATTENTION | MEMORY | ELEMENTWISE: which efficiency applies
    flops: float
    bytes: float
    launches: float = 1.0
    rows: float = 0.0  # the rows (tokens, query rows) the efficiency curve reads
    call: str = ""  # MATMUL | PREFILL | DECODE: which fixed cost per call; "" none
    # attention's kernel blocks: the bytes they stream, the keys of the longest, how many
    streamed: float = 0.0
    span: float = 0.0
    blocks: float = 0.0
    split: float = 0.0  # 1: its blocks may split their keys (a packed decode call)
    # vLLM's paged kernel (`paged_blocks`): its blocks' 128-key tiles, its blocks with rows
    # and empty ones, the K/V bytes the other query heads of each KV head read again unless
    # L2 still holds them, and the blocks with rows per query head (in grid order, one
    # head's blocks after another's)
    tiles: float = 0.0
    tile_blocks: float = 0.0
    empty: float = 0.0
    reread: float = 0.0
    reuse: float = 0.0
    # an element-wise op's input written `behind` bytes of L2 traffic (weights, activations)
    # earlier (a fused add + RMSNorm's residual): `stale` bytes of it, read from DRAM where
    # an L2 of the profile's `l2_reuse_bytes` has evicted them (`evicted`)
    stale: float = 0.0
    behind: float = 0.0


@dataclass(frozen=True)
class Shape:
    """What the cost model needs of a decoder (a `ModelConfig` has all of it)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, config) -> Shape:
        return cls(*(getattr(config, f) for f in cls.__dataclass_fields__))


@dataclass
class StepShape:
    """One step as the cost model reads it. `prefill_q[i]` query tokens after
    `prefill_start[i]` cached ones; `decode_keys[j]` keys of decode row j (its
    context including its new tokens), priced as a decode kernel's attention;
    `decode_q[j]` that row's query tokens (None: one each; a row verifying d drafts
    has d + 1, causal among themselves); `sampling` rows reach the LM head."""

    prefill_q: np.ndarray
    prefill_start: np.ndarray
    decode_keys: np.ndarray
    sampling: int
    padded: bool = False
    decode_q: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        prefill = int(self.prefill_q.sum()) if len(self.prefill_q) else 0
        if self.decode_q is not None:
            return prefill + int(self.decode_q.sum())
        return prefill + len(self.decode_keys)

    def decode_sums(self) -> tuple[float, int, float, float]:
        """The decode rows' keys, rows, query tokens and the query-key pairs they
        score (a row of q queries over k keys: q k - q (q - 1) / 2), each summed."""
        keys, rows = float(self.decode_keys.sum()), len(self.decode_keys)
        if self.decode_q is None:
            return keys, rows, float(rows), keys
        q = self.decode_q
        pairs = float(np.sum(q * self.decode_keys - q * (q - 1) / 2))
        return keys, rows, float(q.sum()), pairs

    @property
    def num_seqs(self) -> int:
        return len(self.prefill_q) + len(self.decode_keys)


def step_shape(plan, padded: bool = False) -> StepShape:
    """A `StepPlan` as the cost model reads it, by shape: a row of one token is a
    one-query row (the plan's decodes, and any other one-token chunk: its attention
    costs what a decode's does), a row verifying d drafts a decode of d + 1 query
    tokens against its context (its weights read once, as a decode's, its K/V read
    once; d + 1 rows of logits), a longer one a prefill chunk."""
    counts, starts = plan.counts, plan.starts
    if len(counts) == plan.num_decodes:  # only one-token rows: no split to make
        return StepShape(_EMPTY, _EMPTY, starts + 1.0, len(counts), padded)
    decode = counts == 1
    drafts = plan.draft_counts
    queries = None
    sampling = int(plan.samples.sum())
    if drafts is not None and drafts.any():
        decode = decode | (drafts > 0)
        queries = counts[decode].astype(np.float64)
        sampling += int(drafts.sum())
    return StepShape(
        counts[~decode].astype(np.float64),
        starts[~decode].astype(np.float64),
        starts[decode] + (1.0 if queries is None else queries),
        sampling,
        padded,
        queries,
    )


def attention_flops(q, start, head_dim: int, heads: float) -> float:
    """4 d heads x sum over chunks of q s + q (q + 1) / 2 (causal, after s cached)."""
    q = np.asarray(q, dtype=np.float64)
    s = np.asarray(start, dtype=np.float64)
    return float(4 * head_dim * heads * (q * s + q * (q + 1) / 2).sum())


def prefill_blocks(q, start, heads: float, bytes_per_head: float) -> tuple[float, float, float]:
    """Streamed bytes, keys of the longest block and blocks of prefill chunks of `q`
    tokens after `start` cached: each chunk is ceil(q / BLOCK_ROWS) tiles per query head,
    a tile reading the K/V of the keys its last row attends to (causal)."""
    q = np.asarray(q, dtype=np.float64)
    s = np.asarray(start, dtype=np.float64)
    tiles = np.ceil(q / BLOCK_ROWS)
    # the tiles' key counts s + 128, s + 256, ..., s + q, summed per chunk
    full = tiles - 1
    keys = tiles * s + BLOCK_ROWS * full * (full + 1) / 2 + q
    streamed = float(bytes_per_head * 2 * heads * keys.sum())
    return streamed, float((s + q).max()), float(heads * tiles.sum())


def paged_blocks(q, start, decode_keys, heads: float, decode_heads: float) -> dict[str, float]:
    """The blocks of one call of vLLM's paged FlashAttention 2 (`Op.tiles`,
    `Op.tile_blocks`, `Op.empty`, `Op.reuse`): chunks of `q` tokens after `start` cached
    and decodes over `decode_keys` keys each, a block per query head (a decode's: per `decode_heads`, the KV heads when
    packed) and 64 query rows of a sequence, computing whole 128-key tiles up to the keys
    of its last row (causal). The grid is the longest chunk's row blocks x the sequences x
    the query heads: a sequence's row blocks past its rows are empty."""
    q = np.asarray(q, dtype=np.float64)
    m = np.ceil(q / PAGED_ROWS)
    size = m.astype(np.int64)
    row = np.arange(size.sum()) - np.repeat(np.cumsum(size) - size, size)  # block within its chunk
    keys = np.repeat(start, size) + np.minimum(PAGED_ROWS * (row + 1.0), np.repeat(q, size))
    chunk_tiles = float(np.ceil(keys / BLOCK_ROWS).sum())
    decode_tiles = float(np.ceil(np.asarray(decode_keys) / BLOCK_ROWS).sum())
    per_head = float(m.sum()) + len(decode_keys)
    grid = heads * (len(q) + len(decode_keys)) * (float(m.max()) if len(m) else 1.0)
    return {"tiles": heads * chunk_tiles + decode_heads * decode_tiles,
            "tile_blocks": heads * float(m.sum()) + decode_heads * len(decode_keys),
            "empty": grid - heads * per_head, "reuse": per_head}  # fmt: skip


def split_blocks(span, blocks, split, wave: float):
    """An attention call's longest block's keys, its blocks and the waves they take when
    `wave` blocks run at once: a call that may `split` (a packed decode) and has fewer
    blocks splits each block's keys, in tiles of BLOCK_ROWS keys at least, until it has
    `wave` (split-KV decoding); more take blocks / wave waves. Scalars or arrays."""
    if not wave:
        return span, blocks, 1.0
    if np.ndim(span) == 0:  # one op (the hot path): plain floats
        splits = max(1.0, min(wave / blocks, span / BLOCK_ROWS)) if split and blocks else 1.0
        span, blocks = span / splits, blocks * splits
        return span, blocks, max(1.0, blocks / wave)
    safe = np.where(blocks > 0, blocks, 1.0)
    splits = np.where(split > 0, np.clip(np.minimum(wave / safe, span / BLOCK_ROWS), 1.0, None), 1.0)
    span, blocks = span / splits, blocks * splits
    return span, blocks, np.maximum(1.0, blocks / wave)


def matmul_op(name: str, tokens: float, m: float, n: float, e: float) -> Op:
    flops, data = 2 * tokens * m * n, e * (m * n + tokens * m + tokens * n)
    return Op(name, MATMUL, flops, data, rows=tokens, call=MATMUL)


def elementwise_ops(tokens: float, h: float, qk_width: float, inter: float, e: float) -> list[Op]:
    """One layer's element-wise kernels on `tokens` rows: two RMSNorms and two residual
    adds of width h, RoPE on q and k (`qk_width` = (H + K) d / p), SiLU x up (I / p)."""
    t = tokens
    return [
        Op("rms_norm", ELEMENTWISE, 0.0, e * t * 2 * 2 * h, launches=2, rows=t),
        Op("residual_add", ELEMENTWISE, 0.0, e * t * 2 * 3 * h, launches=2, rows=t),
        Op("rope", ELEMENTWISE, 0.0, e * t * 2 * qk_width, rows=t),
        Op("activation", ELEMENTWISE, 0.0, e * t * 3 * inter, rows=t),
    ]


def evicted(stale, behind, reuse):
    """Of `stale` bytes written before `behind` more bytes passed through an L2 that keeps
    `reuse` bytes (least recently used out first), those evicted: all that the
    `stale + behind` bytes overflow, the stale ones being the oldest."""
    return np.minimum(np.maximum(stale + behind - reuse, 0.0), stale)


def residual_rereads(c: Shape, p: int, t: float, e: float, share: float = 1.0,
                     which: tuple[str, ...] = ("attention", "mlp")) -> list[Op]:  # fmt: skip
    """A layer's fused add + RMSNorm kernels read the residual the norm before wrote; between,
    a block's weights and activations passed through L2 (the post-attention norm's: the
    qkv and o weights, the norm's, qkv's, the K/V cache's, attention's and o's outputs; the next input
    norm's: the gate_up and down weights, the norm's, gate_up's, the activation's and
    down's outputs; attention's K/V reads not counted). What of the residual's
    `share` x e t h bytes an L2 of `l2_reuse_bytes` no longer holds (`evicted`) comes
    from DRAM. Zero-byte, launch-free ops carrying `stale` and `behind` alone."""
    h, d, heads, kv, inter = c.hidden_size, c.head_dim, c.num_heads / p, c.num_kv_heads / p, c.intermediate_size / p
    behind = {
        "attention": e * (h * (heads + 2 * kv) * d + heads * d * h
                          + t * (h + (heads + 2 * kv) * d + 2 * kv * d + heads * d + h)),
        "mlp": e * (3 * h * inter + t * (h + 2 * inter + inter + h)),
    }  # fmt: skip
    return [Op("residual_reread", ELEMENTWISE, 0.0, 0.0, launches=0.0, rows=t,
               stale=share * e * t * h, behind=behind[w]) for w in which]  # fmt: skip


def collective_time(profile: HardwareProfile, p: int, data: float, passes: int) -> float:
    """A collective over `p` devices moving `passes` x (p - 1) / p of `data` bytes per
    device: the latency floor (and its share per further device), then the links at the
    bandwidth a message of `data` bytes reaches; 0 on one device."""
    if p == 1:
        return 0.0
    half, exponent = profile.interconnect_half_bytes, profile.interconnect_curve_exponent
    curve = data / (data + half) if half else 1.0
    if half and exponent != 1.0:
        curve = curve**exponent
    bandwidth = profile.interconnect_bandwidth * curve
    latency = profile.interconnect_latency + profile.interconnect_latency_per_device * (p - 1)
    return latency + passes * (p - 1) / p * data / bandwidth


class CostModel:
    def __init__(
        self,
        shape: Shape,
        profile: HardwareProfile,
        dtype: str,
        bytes_per_element: int,
        tp: int = 1,
        host: HostProfile | None = None,
    ) -> None:
        self.shape, self.profile, self.e, self.tp = shape, profile, float(bytes_per_element), tp
        # the engine's own work per step (None: the hardware profile's step and seq overheads)
        self.host = host or HostProfile.of_hardware(profile)
        peak = profile.flops(dtype)
        self.rate = {
            MATMUL: peak * profile.matmul_efficiency,
            ATTENTION: peak * profile.attention_efficiency,
            MEMORY: float("inf"),
            ELEMENTWISE: float("inf"),
        }
        self.bandwidth = profile.memory_bandwidth * profile.bandwidth_efficiency
        elementwise = profile.elementwise_efficiency or profile.bandwidth_efficiency
        self.bandwidth_of = {kind: self.bandwidth for kind in self.rate}
        self.bandwidth_of[ELEMENTWISE] = profile.memory_bandwidth * elementwise
        self.full_rows = {kind: 0.0 for kind in self.rate}
        self.full_rows[ELEMENTWISE] = profile.elementwise_full_rows
        self.half_rows = {
            MATMUL: profile.matmul_half_rows,
            ATTENTION: profile.attention_half_rows,
            MEMORY: 0.0,
            ELEMENTWISE: 0.0,
        }
        self.kernel_bandwidth = {
            name: profile.memory_bandwidth * eff for name, eff in profile.kernel_efficiency.items()
        }
        self.call_cost = {
            "": 0.0,
            MATMUL: profile.matmul_overhead,
            PREFILL: profile.attention_prefill_overhead,
            DECODE: profile.attention_decode_overhead,
        }
        stream = profile.memory_bandwidth * profile.attention_stream_efficiency
        self.tiled = bool(profile.attention_sms)
        self.blocks_priced = bool(stream or profile.attention_key_time or self.tiled
                                  or profile.attention_block_overhead)  # fmt: skip
        self.l2_bytes = profile.l2_bytes or float("inf")
        self.reuse_bytes = profile.l2_reuse_bytes
        self.packing = profile.attention_gqa_packing
        self.unified = bool(profile.attention_unified)
        self.stream_bandwidth = stream or float("inf")
        # the priced pieces (_token_parts, _once_time), shared by every cost model of the
        # same shape, profile, dtype and tp (a cluster's replicas price the same steps)
        key = (shape, repr(profile), dtype, self.e, tp)
        if key not in _PRICED and len(_PRICED) >= PRICED_MODELS:
            _PRICED.clear()  # a fit tries many profiles: keep the registry small
        self._by_tokens, self._by_step = _PRICED.setdefault(key, ({}, {}))

    def curve(self, op: Op) -> float:
        """The share of its class's efficiency an op of `op.rows` rows reaches."""
        half = self.half_rows[op.kind]
        return op.rows / (op.rows + half) if half and op.rows else 1.0

    def op_time(self, op: Op) -> float:
        seconds = self.seconds(op.kind, op.flops, op.bytes, op.rows, op.launches, op.call,
                               op.name)  # fmt: skip
        if op.blocks and self.blocks_priced:
            seconds = self.with_blocks(seconds, op)
        if op.stale and self.reuse_bytes:  # the bytes L2 evicted: read again from DRAM
            seconds += evicted(op.stale, op.behind, self.reuse_bytes) / self.bandwidth
        return seconds

    def with_blocks(self, seconds: float, op: Op) -> float:
        """An attention op's time held up to what its kernel blocks cost: their streamed
        bytes, the longest block's keys, their count (each term 0 where its figure is); with
        `attention_sms`, a call with a prefill chunk by its tiles (`held_to_tiles`)."""
        if self.tiled and op.tiles:
            return self.held_to_tiles(seconds, op)
        return self.held_to_blocks(seconds, op.streamed, op.span, op.blocks, op.launches,
                                   op.call, op.split)  # fmt: skip

    def held_to_blocks(self, seconds: float, streamed: float, span: float, blocks: float,
                       launches: float, call: str, split: float = 0.0) -> float:  # fmt: skip
        """`with_blocks` of the op these fields describe (the hot path prices without an Op)."""
        prof = self.profile
        fixed = launches * prof.launch_overhead + self.call_cost[call]
        span, blocks, waves = split_blocks(span, blocks, split, prof.attention_wave_blocks)
        held = max(streamed / self.stream_bandwidth, span * prof.attention_key_time * waves,
                   blocks * prof.attention_block_overhead)  # fmt: skip
        return max(seconds, held + fixed)

    def held_to_tiles(self, seconds: float, op: Op) -> float:
        """A call of vLLM's paged kernel (`paged_blocks`) held up to its blocks: their tiles
        and per-block cost over `attention_sms` SMs, in whole waves of the mean block (blocks
        of a call are of about one length) or the longest block alone; its DRAM bytes, each
        KV head's K/V read again by the blocks of its other query heads that fall in another
        wave (one head's blocks after another's: a share reuse / SMs of them); and its empty
        blocks."""
        prof = self.profile
        sms, tile = prof.attention_sms, prof.attention_tile_time
        block = prof.attention_block_overhead * sms
        blocks = op.tile_blocks
        work = op.tiles * tile + blocks * block
        longest = math.ceil(op.span / BLOCK_ROWS) * tile + block
        compute = max(math.ceil(blocks / sms) * work / blocks, longest)
        dram = (op.bytes + op.reread * min(1.0, op.reuse / sms)) / self.bandwidth
        empty = op.empty * prof.attention_empty_block_time / sms
        fixed = op.launches * prof.launch_overhead + self.call_cost[op.call]
        return max(seconds, max(compute, dram) + empty + fixed)

    def seconds(self, kind: str, flops: float, data: float, rows: float,
                launches: float = 1.0, call: str = "", name: str = "") -> float:  # fmt: skip
        """`op_time` of the op these fields describe (the hot path prices without an Op)."""
        compute = 0.0
        if flops:
            half = self.half_rows[kind]
            compute = flops / (self.rate[kind] * (rows / (rows + half) if half and rows else 1.0))
        memory = 0.0
        if data:
            bandwidth = self.bandwidth_of[kind]
            if kind == ELEMENTWISE:
                bandwidth = self.kernel_bandwidth.get(name, bandwidth)
            full = self.full_rows[kind]
            wave = max(rows, full) / rows if full and rows else 1.0
            memory = data * wave / bandwidth
            if kind == ELEMENTWISE and data > self.l2_bytes:  # what L2 cannot hold: DRAM
                memory = max(memory, (data - self.l2_bytes) / self.bandwidth)
        fixed = launches * self.profile.launch_overhead + self.call_cost[call]
        return max(compute, memory) + fixed

    # -- the operations of one step
    def layer_ops(self, step: StepShape) -> list[Op]:
        """The operations of one layer (every layer is the same)."""
        t = step.num_tokens
        return self.layer_matmul_ops(t) + self.attention_ops(step) + self.layer_elementwise_ops(t)

    def layer_matmul_ops(self, t: float) -> list[Op]:
        """One layer's projections of `t` tokens."""
        c, p, e = self.shape, self.tp, self.e
        d, heads, kv = c.head_dim, c.num_heads / p, c.num_kv_heads / p
        h, inter = c.hidden_size, c.intermediate_size / p
        return [
            matmul_op("qkv_proj", t, h, (heads + 2 * kv) * d, e),
            matmul_op("o_proj", t, heads * d, h, e),
            matmul_op("gate_up_proj", t, h, 2 * inter, e),
            matmul_op("down_proj", t, inter, h, e),
        ]

    def layer_elementwise_ops(self, t: float) -> list[Op]:
        """One layer's element-wise kernels on `t` tokens."""
        c, p = self.shape, self.tp
        d, heads, kv = c.head_dim, c.num_heads / p, c.num_kv_heads / p
        ops = elementwise_ops(t, c.hidden_size, (heads + kv) * d, c.intermediate_size / p, self.e)
        if self.reuse_bytes:  # the two fused norms' residuals, read again after L2 traffic
            ops += residual_rereads(c, p, t, self.e)
        return ops

    def attention_ops(self, step: StepShape) -> list[Op]:
        c, p, e = self.shape, self.tp, self.e
        d, heads, kv = c.head_dim, c.num_heads / p, c.num_kv_heads / p
        if step.padded and step.num_seqs:
            keys = np.concatenate([step.prefill_start + step.prefill_q, step.decode_keys])
            ones = np.ones(len(step.decode_keys))
            decode_q = ones if step.decode_q is None else step.decode_q
            queries = np.concatenate([step.prefill_q, decode_q])
            n, max_q, max_k = step.num_seqs, float(queries.max()), float(keys.max())
            flops = 4 * d * heads * n * max_q * max_k
            data = e * d * (2 * kv * n * max_k + 2 * kv * step.num_tokens + 2 * heads * n * max_q)
            call = PREFILL if max_q > 1 else DECODE
            return [Op("attention_padded", ATTENTION, flops, data, rows=n * max_q, call=call)]
        ops = []
        if self.unified and len(step.prefill_q) and len(step.decode_keys):
            return [self.mixed_op(step)]
        if len(step.prefill_q):
            q, s = step.prefill_q, step.prefill_start
            flops = attention_flops(q, s, d, heads)
            queries = q.sum()  # numpy's sum, once (the array method: no dispatch)
            data = e * d * (2 * kv * (s + q).sum() + 2 * kv * queries + 2 * heads * queries)
            rows = float(queries)
            streamed, span, blocks = prefill_blocks(q, s, heads, e * d)
            paged = paged_blocks(q, s, _EMPTY, heads, heads) if self.tiled else {}
            ops.append(Op("attention_prefill", ATTENTION, flops, float(data), rows=rows,
                          call=PREFILL, streamed=streamed, span=span, blocks=blocks,
                          **paged))  # fmt: skip
        if len(step.decode_keys):
            ops.append(self.decode_op(*step.decode_sums(), packed=self.packed(step)))
        return ops

    def mixed_op(self, step: StepShape) -> Op:
        """Prefill chunks and decodes in one kernel call (`attention_unified`): one fixed
        cost, their flops, bytes, rows, blocks and streamed bytes summed, the longest
        block the longest of either."""
        c = self.shape
        q, s = step.prefill_q, step.prefill_start
        d, heads, kv = c.head_dim, c.num_heads / self.tp, c.num_kv_heads / self.tp
        flops = attention_flops(q, s, d, heads)
        data = self.e * d * (2 * kv * np.sum(s + q) + 2 * kv * np.sum(q) + 2 * heads * np.sum(q))
        streamed, span, blocks = prefill_blocks(q, s, heads, self.e * d)
        packed = self.packed(step)
        decode = self.decode_op(*step.decode_sums(), packed=packed)
        paged = {}
        if self.tiled:  # the paged kernel's blocks (`held_to_tiles`)
            paged = paged_blocks(q, s, step.decode_keys, heads, kv if packed else heads)
            # unpacked, each KV head's K/V is read by its query heads' blocks, one head's
            # sweep over the sequences after another's: the first reads it from DRAM, the
            # others again unless L2 still holds it
            if not packed:
                paged["reread"] = self.e * d * 2 * (heads - kv) * float(step.decode_keys.sum())
        return Op("attention_mixed", ATTENTION, flops + decode.flops, float(data) + decode.bytes,
                  rows=float(np.sum(q)) + decode.rows, call=PREFILL,
                  streamed=streamed + decode.streamed, span=max(span, decode.span),
                  blocks=blocks + decode.blocks, **paged)  # fmt: skip

    def packed(self, step: StepShape) -> bool:
        """Whether the step's decodes pack each KV head's query heads into one block
        (`attention_gqa_packing`: 2 always, 1 when the step is one-query decodes alone)."""
        if self.packing >= 2:
            return True
        if self.packing < 1 or len(step.prefill_q):
            return False
        return step.decode_q is None or bool(np.all(step.decode_q == 1))

    def decode_op(self, keys: float, rows: int, queries: float, pairs: float,
                  packed: bool = False) -> Op:  # fmt: skip
        """The decode rows' attention op (`StepShape.decode_sums`): one call, a block per
        query head of each sequence (`packed`: per KV head), its rows' query tokens as the
        curve's rows."""
        flops, data = self.decode_attention(keys, rows, queries, pairs)
        streamed, span, blocks = self.decode_blocks(keys, rows, packed)
        return Op("attention_decode", ATTENTION, flops, data, rows=queries, call=DECODE,
                  streamed=streamed, span=span, blocks=blocks, split=float(packed))  # fmt: skip

    def decode_blocks(self, keys: float, rows: int, packed: bool = False) -> tuple[float, float, float]:
        """Streamed bytes, keys of the longest block (the mean sequence's: the hot path
        knows the sum alone) and blocks of `rows` decodes over `keys` keys in all: a block
        per query head of each sequence, or with `packed` per KV head (read once)."""
        c = self.shape
        heads = (c.num_kv_heads if packed else c.num_heads) / self.tp
        return self.e * c.head_dim * 2 * heads * keys, keys / rows, rows * heads

    def decode_attention(
        self, keys: float, rows: int, queries: float | None = None, pairs: float | None = None
    ) -> tuple[float, float]:
        """Flops and bytes of `rows` decodes attending over `keys` keys in all: `queries`
        query tokens scoring `pairs` query-key pairs (None: one query a row, scoring
        every key once); each row's K/V read once, its new tokens' K/V written."""
        c, p, e = self.shape, self.tp, self.e
        d, heads, kv = c.head_dim, c.num_heads / p, c.num_kv_heads / p
        q = rows if queries is None else queries
        flops = 4 * d * heads * (keys if pairs is None else pairs)
        return flops, e * d * (2 * kv * keys + 2 * kv * q + 2 * heads * q)

    def _collective_time(self, data: float, passes: int) -> float:
        """A collective over the p devices moving `passes` x (p - 1) / p of `data`
        bytes per device; 0 on one device."""
        return collective_time(self.profile, self.tp, data, passes)

    def all_reduce_time(self, tokens: float) -> float:
        """One ring all-reduce of the step's hidden states (reduce-scatter, then all-gather)."""
        return self._collective_time(self.e * tokens * self.shape.hidden_size, passes=2)

    def gather_time(self, rows: float) -> float:
        """Rank 0 gathering every other rank's chunk of `rows` rows of logits; 0 without rows."""
        if not rows:
            return 0.0
        return self._collective_time(self.e * rows * self.shape.vocab_size, passes=1)

    def step_ops(self, step: StepShape) -> list[Op]:
        """The once-per-step operations: embedding, final norm, LM head, sampling."""
        c, e, s = self.shape, self.e, step.sampling
        h, vocab = c.hidden_size, c.vocab_size / self.tp
        ops = [Op("embedding", MEMORY, 0.0, e * step.num_tokens * h)]
        if s:
            ops += [
                Op("final_norm", ELEMENTWISE, 0.0, e * 2 * s * h, rows=s),
                matmul_op("lm_head", s, h, vocab, e),
                Op("sample", MEMORY, 0.0, e * s * vocab),
            ]
        return ops

    def host_time(self, step: StepShape, finishing: int = 0) -> float:
        """The engine's own work in the step (`finishing`: requests it ends)."""
        return self.host.seconds(step, finishing)

    def step_time(self, step: StepShape, finishing: int = 0) -> float:
        """Seconds one step takes: layers, collectives, the step's own ops, host work."""
        # = sum(op_time(op) for op in layer_ops(step)) + 2 all-reduces, summed in the same
        # order (so to the same bit), with what depends on the token count alone priced once
        tokens = step.num_tokens
        matmuls, elementwise, reduces = self._token_parts(tokens)
        layer = sum(matmuls)
        if step.padded or len(step.prefill_q):
            for op in self.attention_ops(step):
                layer += self.op_time(op)
        elif step.decode_q is not None:  # decodes, some verifying drafts
            layer += self.op_time(self.decode_op(*step.decode_sums(), packed=self.packed(step)))
        else:  # only one-query decodes (most steps): the decode op, priced without building it
            rows = len(step.decode_keys)
            keys = float(step.decode_keys.sum())
            flops, data = self.decode_attention(keys, rows)
            seconds = self.seconds(ATTENTION, flops, data, rows, 1.0, DECODE)
            if self.blocks_priced:
                split = float(self.packing >= 1)
                streamed, span, blocks = self.decode_blocks(keys, rows, self.packing >= 1)
                seconds = self.held_to_blocks(seconds, streamed, span, blocks, 1.0, DECODE, split)
            layer += seconds
        for seconds in elementwise:
            layer += seconds
        layer += reduces
        once = self._once_time(tokens, step.sampling)
        return self.shape.num_layers * layer + once + self.host_time(step, finishing)

    def device_time(self, step: StepShape) -> float:
        """`step_time` without the host's work: a forward run back to back with others
        inside one engine step (a draft model's, whose host work the step pays once)."""
        return self.step_time(step) - self.host_time(step)

    def _token_parts(self, tokens: int) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        """A layer's matmul times, element-wise times (in `layer_ops`' order) and its two
        all-reduces, for a step of `tokens` tokens (cached: a run sees few token counts)."""
        parts = self._by_tokens.get(tokens)
        if parts is None:
            matmuls = tuple(self.op_time(op) for op in self.layer_matmul_ops(tokens))
            elementwise = tuple(self.op_time(op) for op in self.layer_elementwise_ops(tokens))
            parts = (matmuls, elementwise, 2 * self.all_reduce_time(tokens))
            if len(self._by_tokens) >= CACHE_SIZE:
                self._by_tokens.clear()
            self._by_tokens[tokens] = parts
        return parts

    def _once_time(self, tokens: int, sampling: int) -> float:
        """The once-a-step ops and tensor parallelism's once-a-step collectives (the
        embeddings, the logits), cached by (tokens, sampling rows)."""
        seconds = self._by_step.get((tokens, sampling))
        if seconds is None:
            step = StepShape(_EMPTY, _EMPTY, np.zeros(tokens), sampling)
            seconds = sum(self.op_time(op) for op in self.step_ops(step))
            seconds += self.all_reduce_time(tokens) + self.gather_time(sampling)
            if len(self._by_step) >= CACHE_SIZE:
                self._by_step.clear()
            self._by_step[(tokens, sampling)] = seconds
        return seconds

    def copy_time(self, swap_bytes: float, copy_bytes: float) -> float:
        """Block copies: swaps over the host link, copy-on-write in device memory
        (read and write), each device moving its 1/p share."""
        prof, p, t = self.profile, self.tp, 0.0
        if swap_bytes:
            t += swap_bytes / p / prof.host_link_bandwidth + prof.launch_overhead
        if copy_bytes:
            t += 2 * copy_bytes / p / self.bandwidth + prof.launch_overhead
        return t
