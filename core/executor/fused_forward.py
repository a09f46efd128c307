"""`FusedForward`: the model's forward on CUDA with the layer's small ops fused
(`servelab.kernels.triton_fused`), so a decode step launches about ten kernels
per layer instead of forty: the residual add and RMSNorm as one, q/k norm and
RoPE as one (in place on the qkv projection's output), SiLU-and-mul as one.

It computes the torch forward's operations with the same roundings (the norm's
sum order aside). Weights are read once, when it is built after loading: the
fused projections, the norm weights, the RoPE tables (gathered in the kernel
at each token's position, never once per step). The CPU keeps `TorchForward`
or the C++ kernels; the kernels module is imported only when this is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelab.model.transformer import FusedLinear, Transformer


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors, read once."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.nn.Linear
    gate_up: torch.Tensor
    down_proj: torch.nn.Linear


def _fused_weight(fused: FusedLinear | None, linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused matmul's weight and bias (concatenated once where they are not current)."""
    if fused is not None and fused.is_current():
        return fused.weight, fused.bias
    weight = torch.cat([lin.weight for lin in linears])
    has_bias = all(lin.bias is not None for lin in linears)
    return weight, torch.cat([lin.bias for lin in linears]) if has_bias else None


def layer_weights(layer) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv_weight, qkv_bias = _fused_weight(attn.qkv, [attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, _ = _fused_weight(mlp.gate_up, [mlp.gate_proj, mlp.up_proj])
    has_qk_norm = attn.q_norm is not None
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        qkv_weight=qkv_weight,
        qkv_bias=qkv_bias,
        q_norm=attn.q_norm.weight if has_qk_norm else None,
        k_norm=attn.k_norm.weight if has_qk_norm else None,
        o_proj=attn.o_proj,
        gate_up=gate_up,
        down_proj=mlp.down_proj,
    )


class FusedForward:
    """The decoder with fused Triton ops around the projections and attention."""

    cpu_kernels = False

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.ops = importlib.import_module("servelab.kernels.triton_fused")
        config = model.config
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim, self.eps = config.head_dim, config.rms_norm_eps
        self.layers = [layer_weights(layer) for layer in model.model.layers]
        self.final_norm = model.model.norm.weight

    def forward(self, input_ids, positions, kv_caches, backend, attn_plan) -> torch.Tensor:
        ops, eps = self.ops, self.eps
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self.model.rope_cos, self.model.rope_sin
        x = self.model.model.embed_tokens(input_ids)
        residual = None
        num_tokens = x.shape[0]
        all_reduce = self.model.all_reduce  # tensor parallelism: sum the row-parallel outputs
        for w, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = ops.add_rms_norm(x, residual, w.input_norm, eps)
            qkv = F.linear(h, w.qkv_weight, w.qkv_bias).view(
                num_tokens, heads + 2 * kv_heads, head_dim
            )
            ops.qk_norm_rope(qkv, heads, kv_heads, w.q_norm, w.k_norm, eps, cos, sin, positions)
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
            out = backend.forward(q, k, v, kv_cache, attn_plan)
            x = w.o_proj(out.reshape(num_tokens, heads * head_dim))
            if all_reduce is not None:
                x = all_reduce(x)
            h, residual = ops.add_rms_norm(x, residual, w.post_norm, eps)
            x = w.down_proj(ops.silu_mul(F.linear(h, w.gate_up)))
            if all_reduce is not None:
                x = all_reduce(x)
        return ops.add_rms_norm(x, residual, self.final_norm, eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)
