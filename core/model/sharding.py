"""`Shard`: which slice of every weight one rank of a tensor-parallel group holds.

Megatron's split, by parameter name, so a checkpoint is read slice by slice:
- column-parallel (split the output rows): q_proj, k_proj, v_proj (weight and
  bias), gate_proj, up_proj; each rank computes its own heads and its share of
  the MLP's inner width;
- row-parallel (split the input columns): o_proj, down_proj; each rank's output
  is a partial sum that an all-reduce completes. A row-parallel bias is added
  once: rank 0 holds it, the others hold zeros;
- vocabulary-parallel: the embedding and the LM head; each rank holds a
  `vocab_chunk` of consecutive token rows (the last one padded with zero rows
  when the ranks do not divide the vocabulary). A rank embeds the tokens in
  its rows, zeros elsewhere, and an all-reduce completes every embedding; a
  rank's LM head gives its chunk of the logits, and rank 0 gathers the chunks;
- replicated: every norm (q/k norms are per head_dim).
KV heads: split when their count is a multiple of the ranks; with fewer KV heads
than ranks (and ranks a multiple of them) each KV head is replicated on
`ranks / kv_heads` consecutive ranks, the ones whose query heads read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelab.errors import ConfigError
from servelab.model.config import ModelConfig

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


def parameter_parts(name: str) -> tuple[str, str]:
    """(the projection or module, the tensor kind) of a parameter name:
    `model.layers.0.self_attn.q_proj.weight` -> `("q_proj", "weight")`."""
    module, _, kind = name.rpartition(".")
    return module.rpartition(".")[2], kind


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """A ConfigError when `config` cannot be split over `size` ranks, naming the counts."""
    problems = []
    if config.num_heads % size:
        problems.append(f"its {config.num_heads} attention heads")
    if config.intermediate_size % size:
        problems.append(f"its MLP width {config.intermediate_size}")
    kv = config.num_kv_heads
    if kv >= size and kv % size:
        problems.append(f"its {kv} KV heads (a multiple of the ranks, to split them)")
    if kv < size and size % kv:
        problems.append(f"its {kv} KV heads (the ranks a multiple of them, to replicate them)")
    if problems:
        raise ConfigError(
            f"tensor_parallel_size={size} must divide the model's shape: {', '.join(problems)}"
        )


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` over the full model shape `config`."""

    config: ModelConfig  # the whole model's shape
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_tensor_parallel(self.config, self.size)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds (1 where they are replicated)."""
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank holds."""
        kv = self.config.num_kv_heads
        if kv >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // kv)  # the KV head of this rank's query heads

    @property
    def vocab_chunk(self) -> int:
        """Token rows of the embedding and the LM head each rank holds (padded)."""
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        """The first token id of this rank's rows."""
        return self.rank * self.vocab_chunk

    @property
    def local_config(self) -> ModelConfig:
        """The shape one rank's modules are built with: its heads, its MLP width,
        its rows of the vocabulary."""
        c = self.config
        return c.replace(
            num_heads=c.num_heads // self.size,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=c.intermediate_size // self.size,
            vocab_size=self.vocab_chunk,
        )

    def slices(self, name: str, full_shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The index of this rank's part of parameter `name` (full shape `full_shape`);
        None: the rank holds it whole (replicated; a row-parallel bias off rank 0
        is then zeroed, see `is_zeroed`)."""
        proj, kind = parameter_parts(name)
        head_dim = self.config.head_dim
        if proj == "q_proj":
            rows = self.config.num_heads // self.size * head_dim
            return (slice(self.rank * rows, (self.rank + 1) * rows),)
        if proj in ("k_proj", "v_proj"):
            start = self.kv_head_start * head_dim
            return (slice(start, start + self.num_kv_heads * head_dim),)
        if proj in ("gate_proj", "up_proj"):
            rows = full_shape[0] // self.size
            return (slice(self.rank * rows, (self.rank + 1) * rows),)
        if proj in ROW_PARALLEL and kind == "weight":
            cols = full_shape[1] // self.size
            return (slice(None), slice(self.rank * cols, (self.rank + 1) * cols))
        if proj in VOCAB_PARALLEL:
            start = min(self.vocab_start, full_shape[0])
            return (slice(start, min(start + self.vocab_chunk, full_shape[0])),)
        return None

    def fit(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """`part` (this rank's slice of `name`) padded with zero rows to the
        vocabulary chunk where the last rank's slice is short."""
        proj, _ = parameter_parts(name)
        missing = self.vocab_chunk - part.shape[0]
        if proj not in VOCAB_PARALLEL or missing <= 0:
            return part
        return torch.cat([part, part.new_zeros((missing, *part.shape[1:]))])

    def is_zeroed(self, name: str) -> bool:
        """Whether this rank holds zeros for `name`: a row-parallel bias off rank 0,
        so the all-reduce adds it once."""
        proj, kind = parameter_parts(name)
        return kind == "bias" and proj in ROW_PARALLEL and self.rank != 0

    def full_shape(self, name: str, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole tensor's shape for parameter `name` of `local_shape` on this rank."""
        proj, kind = parameter_parts(name)
        c = self.config
        if proj == "q_proj":
            return (c.num_heads * c.head_dim, *local_shape[1:])
        if proj in ("k_proj", "v_proj"):
            return (c.num_kv_heads * c.head_dim, *local_shape[1:])
        if proj in ("gate_proj", "up_proj"):
            return (c.intermediate_size, *local_shape[1:])
        if proj in ROW_PARALLEL and kind == "weight":
            return (local_shape[0], local_shape[1] * self.size)
        if proj in VOCAB_PARALLEL:
            return (c.vocab_size, *local_shape[1:])
        return tuple(local_shape)
