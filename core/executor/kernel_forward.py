"""The decoder's forward through servelab's C++ CPU kernels, as one flat program.

A layer is eight kernel calls and the attention backend's `forward`, with the
same formulas in the same order as `servelab.model.transformer`'s torch path;
a layer's output stays `residual + delta`, unsummed, until the next norm adds
it. Flat because at decode sizes a layer's kernels take tens of microseconds,
so Python's share is visible. A backend that implements `PagedKernelAttention`
lets a step run every layer in one C++ call (`cpu_decoder`, bit for bit the
same): on servelab's packed matmul, and for bfloat16 weights at one token (the bf16
row kernel's case). The program packs the weights once (a second copy of each projection)
and packs them again whenever any parameter was replaced or changed in place.
Under tensor parallelism (the model's `all_reduce` set) the o and down matmuls'
partial sums are all-reduced, so the one-call decoder, which has no such step
between its layers, is not used. The projections take `cpu_matmul.path_for`'s
path for the weights' dtype: servelab's packed kernel, or oneDNN over weights
`PackedMatmul` (below) prepacked once. bfloat16 / float16 weights keep float32
activations (norms, RoPE, residual, logits); q/k/v are rounded to the KV cache's
dtype for attention, and on the native bf16 path SwiGLU runs on the gate/up
projection's bf16 output and feeds the down projection in bf16.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from servelab.kernels import cpu_decoder, cpu_fused, cpu_linear, cpu_matmul, huge_pages
from servelab.model.transformer import rope_cos_sin

if TYPE_CHECKING:
    from servelab.model.transformer import Transformer


@runtime_checkable
class PagedKernelAttention(Protocol):
    """An attention backend whose `forward` may be exactly the C++ paged kernel."""

    def cpu_paged_kernel_inputs(
        self, plan: Any, num_layers: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`(slot_mapping, tables, lens)` when, in every one of the step's
        `num_layers` layers, `forward` would be exactly `cpu_paged.store_kv` of
        k/v at `slot_mapping`, then `cpu_paged.paged_decode` of q over `tables`
        and `lens`; the backend then accounts those layers as if `forward` had
        run them. None: the step calls `forward` in every layer."""


class Matmul(NamedTuple):
    """One packed weight (and bias) for `cpu_linear`'s `linear`."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int

    @staticmethod
    def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> Matmul:
        linear = cpu_linear.PackedLinear(weight, bias)
        return Matmul(linear.packed, linear.bias, linear.out_features)


class GatedMatmul(NamedTuple):
    """The fused gate/up weight packed for `cpu_linear`'s `linear_gated`, which
    writes silu(x @ gate.T) * (x @ up.T) straight from its accumulators."""

    packed: torch.Tensor
    inner: int

    @staticmethod
    def pack(weight: torch.Tensor) -> GatedMatmul:
        module = cpu_linear.kernel()
        assert module is not None, "the CPU matmul kernel is not built"
        packed = huge_pages.copy(module.pack_gated_weight(weight.detach()))
        return GatedMatmul(packed, weight.shape[0] // 2)


class LayerProgram(NamedTuple):
    """One layer's weights as its kernels take them: `Matmul` / `GatedMatmul` for
    servelab's kernel, `PackedMatmul` for oneDNN (gate_up then unfused)."""

    attn_norm: torch.Tensor
    attn_eps: float
    qkv: Any
    q_norm: torch.Tensor | None  # Qwen3's per-head norms, else None
    k_norm: torch.Tensor | None
    qk_eps: float
    o: Any
    mlp_norm: torch.Tensor
    mlp_eps: float
    gate_up: Any
    down: Any


def _stacked(linears, fused) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight (and bias) of `linears` side by side: `fused`'s tensors while
    the linears are still its views, else their current ones concatenated."""
    if fused is not None and fused.is_current():
        return fused.weight, fused.bias
    weight = torch.cat([lin.weight for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = None if any(b is None for b in biases) else torch.cat(biases)
    return weight, bias


def _layer_program(layer, servelab: bool, dtype: torch.dtype) -> LayerProgram:
    """`servelab`: packed for servelab's kernel, else `PackedMatmul`s; the norms'
    weights in `dtype`, the activations'."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv_weight, qkv_bias = _stacked([attn.q_proj, attn.k_proj, attn.v_proj], attn.qkv)
    gate_up_weight, _ = _stacked([mlp.gate_proj, mlp.up_proj], mlp.gate_up)
    qk_norm = attn.q_norm is not None
    pack = Matmul.pack if servelab else PackedMatmul
    gate_up = GatedMatmul.pack(gate_up_weight) if servelab else pack(gate_up_weight, None)

    def norm(module) -> torch.Tensor:
        return module.weight.detach().to(dtype)

    return LayerProgram(
        attn_norm=norm(layer.input_layernorm),
        attn_eps=float(layer.input_layernorm.eps),
        qkv=pack(qkv_weight, qkv_bias),
        q_norm=norm(attn.q_norm) if qk_norm else None,
        k_norm=norm(attn.k_norm) if qk_norm else None,
        qk_eps=float(attn.q_norm.eps) if qk_norm else 0.0,
        o=pack(attn.o_proj.weight, attn.o_proj.bias),
        mlp_norm=norm(layer.post_attention_layernorm),
        mlp_eps=float(layer.post_attention_layernorm.eps),
        gate_up=gate_up,
        down=pack(mlp.down_proj.weight, mlp.down_proj.bias),
    )


def parameter_slots(model: torch.nn.Module) -> list[tuple[dict, str]]:
    """Where each parameter lives: its module's `_parameters` dict and its name
    there (assigning a new parameter replaces the dict entry, so reading the
    slot sees it; walking `model.parameters()` every step costs far more)."""
    return [(m._parameters, name) for m in model.modules() for name in m._parameters]


def identity(slots: list[tuple[dict, str]]) -> list:
    """What changes when any parameter may have: each one's storage and version
    counter (an inference tensor has none: its storage alone)."""
    return [
        None if p is None else (p.data_ptr(), p.is_inference() or p._version)
        for p in [params[name] for params, name in slots]
    ]


def _call(x: torch.Tensor, matmul: PackedMatmul) -> torch.Tensor:
    return matmul(x)


def _gated(x: torch.Tensor, matmul: PackedMatmul) -> torch.Tensor:
    # in the matmul's own dtype: on the native bf16 path the down projection reads
    # bf16, so the widest activation is never widened to float32 and narrowed back
    return silu_mul(matmul.native(x), matmul.out_features // 2)


class KernelForward:
    """`Transformer.forward` / `compute_logits` / argmax through the C++ CPU kernels."""

    cpu_kernels = True

    def __init__(self, model: Transformer) -> None:
        self.model = model
        path = cpu_matmul.path_for(model.dtype)
        self._servelab = path.name == "servelab"
        # the activations' dtype: float32 for reduced-precision weights
        self.dtype = torch.float32 if model.dtype in cpu_matmul.REDUCED else model.dtype
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._paged_backend: tuple[Any, bool] = (None, False)  # (backend, implements the protocol)
        self._fused = cpu_fused.kernel()
        # servelab's matmul and one-call decoder: built only for the path that runs them
        self._linear = cpu_linear.kernel() if self._servelab else None
        assert self._fused is not None, "kernels not built"
        assert self._linear is not None or not self._servelab, "kernels not built"
        self._slots = parameter_slots(model)
        head = model.model.embed_tokens if model.lm_head is None else model.lm_head
        self._head_slot = [(head._parameters, "weight")]  # all the LM head reads
        self._head_key: list | None = None
        self._key: list | None = None
        self._layers: list[LayerProgram] = []
        self._final: tuple[torch.Tensor, float] | None = None
        self._lm_head: Any = None
        # the whole layer loop in one C++ call, for steps whose attention is the
        # paged kernel (`cpu_decoder`): on servelab's packed matmul, or over bfloat16
        # weights at one token where the bf16 row kernel runs (`PackedMatmul.bf16_row`);
        # None where neither runs or it cannot be built
        bf16_rows = model.dtype == torch.bfloat16 and path.name == "onednn"
        bf16_rows = bf16_rows and cpu_matmul.bf16_row_kernel() is not None
        self._decoder = cpu_decoder.kernel() if self._servelab or bf16_rows else None
        self._decoder_args: tuple[list, list, list] = ([], [], [])

    def _program(self) -> list[LayerProgram]:
        key = identity(self._slots)
        if key != self._key:
            model, servelab, dtype = self.model, self._servelab, self.dtype
            self._layers = [_layer_program(layer, servelab, dtype) for layer in model.model.layers]
            if self._decoder is not None:
                self._decoder_args = cpu_decoder.layer_arguments(self._layers, not servelab)
            norm = model.model.norm
            self._final = (norm.weight.detach().to(dtype), float(norm.eps))
            params, name = self._head_slot[0]
            pack = Matmul.pack if servelab else PackedMatmul
            self._lm_head = pack(params[name], None)
            if model.rope_cos.dtype == dtype:
                self._rope = (model.rope_cos, model.rope_sin)
            else:  # the model's tables are rounded to its dtype: float64's, in ours
                cos, sin = rope_cos_sin(model.config, model.rope_cos.device)
                self._rope = (cos.to(dtype), sin.to(dtype))
            self._head_key = identity(self._head_slot)
            self._key = key
        return self._layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        backend: Any,
        attn_plan: Any,
    ) -> torch.Tensor:
        layers = self._program()
        model = self.model
        config = model.config
        num_heads, num_kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        cos, sin = self._rope
        embed = model.model.embed_tokens.weight
        # tensor parallelism's all-reduce, read from a layer (the model's property would be
        # one more call per step); None in one process
        blocks = model.model.layers
        all_reduce = blocks[0].mlp.all_reduce if len(blocks) else None
        if (
            self._decoder is not None
            and (self._servelab or input_ids.shape[0] == 1)
            and all_reduce is None
            and kv_caches
            and kv_caches[0][0].dtype == embed.dtype
        ):
            if self._paged_backend[0] is not backend:  # a Protocol isinstance costs microseconds
                self._paged_backend = (backend, isinstance(backend, PagedKernelAttention))
            paged = (
                backend.cpu_paged_kernel_inputs(attn_plan, len(layers))
                if self._paged_backend[1]
                else None
            )
            if paged is not None:  # every layer in one C++ call: the same kernels, in order
                slots, tables, lens = paged
                weight, eps = self._final
                return self._decoder.decoder_forward(
                    input_ids, embed, *self._decoder_args,
                    [c for kv in kv_caches for c in kv],
                    tables, lens, slots, positions, cos, sin,
                    num_heads, num_kv_heads, head_dim, backend.scale, weight, eps,
                )  # fmt: skip
        fused = self._fused
        if self._servelab:
            linear, linear_gated = self._linear.linear, self._linear.linear_gated

            def matmul(x, packed):
                return linear(x, *packed)

            def gated(x, packed):
                return linear_gated(x, *packed)
        else:
            matmul, gated = _call, _gated
        qk_heads = num_heads + num_kv_heads
        head_split = (num_heads, num_kv_heads, num_kv_heads)
        residual = model.model.embed_tokens(input_ids)
        if residual.dtype != self.dtype:
            residual = residual.to(self.dtype)
        kv_dtype = kv_caches[0][0].dtype if kv_caches else self.dtype
        num_tokens = residual.shape[0]
        delta = None
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            if delta is None:  # the first layer: the embeddings are the whole residual
                h = fused.rms_norm(residual, layer.attn_norm, layer.attn_eps)
            else:
                h = fused.add_rms_norm(residual, delta, layer.attn_norm, layer.attn_eps)
            qkv = matmul(h, layer.qkv)
            fused.qk_norm_rope_(
                qkv, layer.q_norm, layer.k_norm, layer.qk_eps, cos, sin, positions,
                num_heads, num_kv_heads,
            )  # fmt: skip
            if kv_dtype != qkv.dtype:  # attention reads and writes the cache's dtype
                qkv = qkv.to(kv_dtype)
            # one split, not three slices: tensor indexing from Python costs microseconds each
            q, k, v = qkv.view(num_tokens, qk_heads + num_kv_heads, head_dim).split(head_split, 1)
            out = backend.forward(q, k, v, kv_cache, attn_plan)
            delta = matmul(out.reshape(num_tokens, num_heads * head_dim), layer.o)
            if all_reduce is not None:
                delta = all_reduce(delta)
            h = fused.add_rms_norm(residual, delta, layer.mlp_norm, layer.mlp_eps)
            delta = matmul(gated(h, layer.gate_up), layer.down)
            if all_reduce is not None:
                delta = all_reduce(delta)
        weight, eps = self._final
        if delta is None:  # a model without layers
            return fused.rms_norm(residual, weight, eps)
        return fused.add_rms_norm(residual, delta, weight, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # after a forward, only the head's own weight needs checking
        if identity(self._head_slot) != self._head_key:
            self._program()
        if self._servelab:
            return self._linear.linear(hidden, *self._lm_head)
        return self._lm_head(hidden)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self._fused.argmax_rows(logits)


class PackedMatmul:
    """`F.linear(x, weight, bias)` for a fixed weight, packed once for
    `cpu_matmul.path_for`'s path: servelab's kernel, or oneDNN's packed linear.

    Holds its own copies: a weight changed in place afterwards is not seen (the
    caller repacks when a parameter changes)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        weight = weight.detach()
        self.path = cpu_matmul.path_for(weight.dtype)
        self.out_features = weight.shape[0]
        dtype = self.path.compute_dtype
        self.out_dtype = torch.float32 if weight.dtype in cpu_matmul.REDUCED else weight.dtype
        self.servelab = None
        self.gemv = None  # the plain weight for MKL's gemv at one or two rows
        # bfloat16 on oneDNN's native path: one row goes through servelab's own kernel over
        # the model's weight as it is (no copy: oneDNN's prepacked one is opaque), which
        # streams it faster than oneDNN at one row (`csrc/cpu_gemv_bf16.h`)
        self.bf16_row = None
        self.weight = weight  # the bf16 row kernel's (and the one-call decoder's)
        if self.path.name == "servelab":
            self.servelab = cpu_linear.PackedLinear(weight, bias)
            self.packed = self.bias = None
            return
        plain = weight.to(dtype)
        if dtype == torch.float32 and weight.dtype == torch.float32:
            self.gemv = (plain, None if bias is None else bias.detach())
        self.packed = torch.ops.mkldnn._reorder_linear_weight(plain, None)
        self.bias = None if bias is None else bias.detach().to(dtype)
        if dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
            self.bf16_row = cpu_matmul.bf16_row_kernel()
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_row is not None and x.shape[0] == 1:  # rounded as oneDNN's bf16 output
            return self.bf16_row(x, self.weight, self.bias, True)
        out = self.native(x)
        return out if out.dtype == self.out_dtype else out.to(self.out_dtype)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """The product in the path's compute dtype (bfloat16 on the native bf16
        path), not widened to `out_dtype`: for a consumer that reads that dtype."""
        if self.servelab is not None:
            return self.servelab(x)
        if self.gemv is not None and x.shape[0] <= cpu_matmul.GEMV_ROWS:
            return F.linear(x, *self.gemv)
        if self.bf16_row is not None and x.shape[0] == 1:  # rounded as oneDNN's bf16 output
            return self.bf16_row(x, self.weight, self.bias, True).to(torch.bfloat16)
        dtype = self.path.compute_dtype
        if x.dtype != dtype:
            x = x.to(dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def silu_mul(gate_up: torch.Tensor, inner: int) -> torch.Tensor:
    """silu(gate) * up for the fused gate/up projection's output `[T, 2 * inner]`,
    as the model's `F.silu(gate) * up`, in the output's dtype (bfloat16 rounds
    twice, as the model's bfloat16 ops do)."""
    out = F.silu(gate_up[:, :inner])
    return out.mul_(gate_up[:, inner:])
