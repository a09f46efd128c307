"""One decoder for Qwen3, Qwen2 and Llama over packed tokens and a paged KV cache.

Rules:
- parameter names mirror Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, ...),
  so a safetensors checkpoint loads by name; `lm_head` is None when tied;
- numerics follow HF op by op (float32 RMSNorm for low precision, SiLU gate, rotate-half
  RoPE), so logits match `transformers` to rounding; a float64 model stays float64 throughout;
- per-step work (the RoPE cos/sin gather) runs once in `forward`, never in a layer;
- q/k/v and gate/up run as one matmul each: their parameters are row views of one fused
  weight (`FusedLinear`; a parameter replaced later falls back to separate matmuls);
- under tensor parallelism (`set_all_reduce`) the model holds one rank's heads, MLP
  width and vocabulary rows (`servelab.model.sharding`); o_proj, down_proj and the
  embedding then give partial sums, which the all-reduce the executor installs
  completes, and `compute_logits` gives the rank's chunk of the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelab.contracts.attention import AttentionBackend
from servelab.kernels import huge_pages
from servelab.model.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]
AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the ranks, in place


class RMSNorm(nn.Module):
    """HF's RMSNorm: variance in at least float32, scale by the weight in the input dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm over the last dim; `weight` broadcasts against `x` (per-head
    weights of several heads at once are fine).

    float32 and float64 take torch's fused kernel, which computes HF's exact
    operations (`x * rsqrt(mean(x^2) + eps)`, then `* weight`) in one pass and
    bit for bit; narrower dtypes are upcast to float32 like HF."""
    if x.dtype in (torch.float32, torch.float64) and weight.dtype == x.dtype:
        return F.rms_norm(x, x.shape[-1:], None, eps) * weight
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


def fuse_linears(linears: list[nn.Linear]) -> FusedLinear:
    """Re-points the weights (and biases) of `linears`, which read the same
    input, at consecutive rows of one new tensor, so one matmul computes them
    all. Call after the parameters are allocated and before they are loaded:
    the old values are not copied."""
    first = linears[0].weight
    rows = [lin.out_features for lin in linears]
    # streamed by every CPU decode step: on huge pages there
    weight = huge_pages.empty((sum(rows), first.shape[1]), first.dtype, first.device)
    has_bias = [lin.bias is not None for lin in linears]
    bias = None
    if all(has_bias):
        bias = torch.empty(sum(rows), dtype=first.dtype, device=first.device)
    offset = 0
    for lin, n in zip(linears, rows):
        lin.weight = nn.Parameter(weight[offset : offset + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[offset : offset + n], requires_grad=False)
        offset += n
    return FusedLinear(weight, bias, linears, rows)


class FusedLinear:
    """One matmul for several linears whose parameters are views of `weight`."""

    def __init__(self, weight, bias, linears: list[nn.Linear], rows: list[int]) -> None:
        self.weight = weight
        self.bias = bias
        self.linears = linears
        self.rows = rows
        # where each linear's parameters must live for the fused tensors to be current
        row_bytes = weight.shape[1] * weight.element_size()
        starts = [sum(rows[:i]) for i in range(len(rows))]
        self._weight_ptrs = [weight.data_ptr() + s * row_bytes for s in starts]
        self._bias_ptrs = (
            [bias.data_ptr() + s * bias.element_size() for s in starts]
            if bias is not None
            else None
        )

    def is_current(self) -> bool:
        """Whether every linear still reads its rows of the fused tensors (a
        parameter replaced or moved since fusing makes this False)."""
        for i, lin in enumerate(self.linears):
            if lin.weight.data_ptr() != self._weight_ptrs[i]:
                return False
            if self._bias_ptrs is not None and lin.bias.data_ptr() != self._bias_ptrs[i]:
                return False
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., sum(rows)]`: the linears' outputs side by side. Under
        `torch.compile` the check is left to the caller (`Transformer.fused_current`,
        before the compiled call): dynamo cannot trace data pointers, and a graph
        break at every projection would split each layer into pieces."""
        if torch.compiler.is_compiling() or self.is_current():
            return F.linear(x, self.weight, self.bias)
        return torch.cat([lin(x) for lin in self.linears], dim=-1)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float64, llama3 scaling applied when set."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    config: ModelConfig, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_position_embeddings, head_dim / 2], computed in float64."""
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float64, device=device)
    angles = positions[:, None] * rope_inv_freq(config).to(device)[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [T, heads, D] with cos/sin [T, 1, D/2]; the same
    floating-point operations as HF's `x * cos + rotate_half(x) * sin`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, q_size, kv_size = (
            config.hidden_size,
            config.num_heads * config.head_dim,
            config.num_kv_heads * config.head_dim,
        )
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, q_size, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_size, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_size, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_proj_bias, dtype=dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: FusedLinear | None = None  # set by `fuse()` once parameters exist
        self.all_reduce: AllReduce | None = None  # tensor parallelism: o_proj's partial sums

    def fuse(self) -> None:
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        backend: AttentionBackend,
        attn_plan: Any,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        qkv = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
        # q and k heads are normalised and rotated together: every op works per head
        qk = qkv[:, : num_heads + num_kv_heads]
        v = qkv[:, num_heads + num_kv_heads :]
        if self.q_norm is not None:  # Qwen3: per-head norm before RoPE
            weight = torch.cat(
                [
                    self.q_norm.weight.expand(num_heads, head_dim),
                    self.k_norm.weight.expand(num_kv_heads, head_dim),
                ]
            )
            qk = rms_norm(qk, weight, self.q_norm.eps)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        out = backend.forward(q, k, v, kv_cache, attn_plan)
        out = self.o_proj(out.reshape(num_tokens, num_heads * head_dim))
        return out if self.all_reduce is None else self.all_reduce(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inner, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inner, hidden, bias=False, dtype=dtype)
        self.gate_up: FusedLinear | None = None  # set by `fuse()` once parameters exist
        self.all_reduce: AllReduce | None = None  # tensor parallelism: down_proj's partial sums

    def fuse(self) -> None:
        self.gate_up = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        else:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        return out if self.all_reduce is None else self.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, dtype)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x, cos, sin, kv_cache, backend, attn_plan) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, backend, attn_plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class VocabParallelEmbedding(nn.Embedding):
    """One rank's rows of the vocabulary, from token `vocab_start` on (tensor
    parallelism): a token outside them embeds as zeros, and the all-reduce sums
    the one rank's row that holds it with the others' zeros. One process keeps
    the plain `nn.Embedding`, so its path (compiled or not) is as it was."""

    def __init__(self, *args, vocab_start: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.vocab_start = vocab_start
        self.all_reduce: AllReduce | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows.masked_fill_(outside[:, None], 0)
        return rows if self.all_reduce is None else self.all_reduce(rows)  # None: this rank's share


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, vocab_start: int | None = None
    ) -> None:
        super().__init__()
        size = (config.vocab_size, config.hidden_size)
        self.embed_tokens = (
            nn.Embedding(*size, dtype=dtype)
            if vocab_start is None
            else VocabParallelEmbedding(*size, dtype=dtype, vocab_start=vocab_start)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class Transformer(nn.Module):
    """The decoder. Parameters are created uninitialised on `device`; fill them
    with `servelab.model.loader` (a checkpoint or seeded random weights).
    `vocab_start`: a tensor-parallel rank's first token row (its `config` holds
    the rank's share of everything); None: one process, the whole model."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        vocab_start: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        # Build on the meta device, then allocate without running nn's own init:
        # every weight is overwritten by the loader anyway.
        with torch.device("meta"):
            self.model = DecoderStack(config, dtype, vocab_start)
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
            )
        # `to_empty`, with the CPU's weights (what a decode step streams) on huge pages
        self._apply(lambda t: huge_pages.empty(t.shape, t.dtype, device))
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        cos, sin = rope_cos_sin(config, device)
        # RoPE tables are derived, not weights: kept out of the state dict
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def all_reduce(self) -> AllReduce | None:
        """The all-reduce completing the row-parallel outputs (None: one process)."""
        layers = self.model.layers
        return layers[0].mlp.all_reduce if len(layers) else None

    def set_all_reduce(self, all_reduce: AllReduce | None) -> None:
        """Makes this model one rank of a tensor-parallel group: every o_proj and
        down_proj output, and the embeddings, are summed over the ranks by `all_reduce`."""
        embed = self.model.embed_tokens
        if isinstance(embed, VocabParallelEmbedding):
            embed.all_reduce = all_reduce
        for layer in self.model.layers:
            layer.self_attn.all_reduce = all_reduce
            layer.mlp.all_reduce = all_reduce

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def fused_current(self) -> bool:
        """Whether every layer's fused projections still read their linears'
        parameters (see `FusedLinear.is_current`)."""
        for layer in self.model.layers:
            for fused in (layer.self_attn.qkv, layer.mlp.gate_up):
                if fused is not None and not fused.is_current():
                    return False
        return True

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (and of its V) cache."""
        return (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        backend: AttentionBackend,
        attn_plan: Any,
    ) -> torch.Tensor:
        """Packed tokens [T] at `positions` [T] -> final hidden states [T, hidden].
        Each layer stores its K/V and attends through `backend.forward`."""
        # gathered once per step, shared by every layer: [T, 1, D/2] broadcasts over heads
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        x = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, backend, attn_plan)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on the selected rows only: [N, hidden] -> [N, vocab] (under
        tensor parallelism [N, the rank's vocabulary rows]; rank 0 gathers them)."""
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)
