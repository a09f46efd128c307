"""The reference side of the oracle: tiny random Hugging Face checkpoints and
transformers' own greedy `generate`.

transformers computes RMSNorm and RoPE in float32 even for a float64 model;
`make_hf_exact_float64` patches those two modules to the same formulas in
float64 (frequencies from an independent scalar formula, `reference_inv_freq`),
so "float64" means float64 all the way and a near-tie can never flip a token on
rounding alone. Everything else — projections, biases, q/k norms, GQA, SDPA,
MLP, the LM head — stays transformers' own code.
"""

from __future__ import annotations

import math
import types

import torch

from servelab.testing.deps import require

transformers = require("transformers", "the reference model of the token-exact oracle")

HF_CLASSES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
}


# -- an independent float64 RoPE: Meta's scalar llama3 formula, plain Python math
def reference_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> list[float]:
    """RoPE inverse frequencies, optionally llama3-scaled, computed one scalar at a time."""
    freqs = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    if scaling is None:
        return freqs
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def _rmsnorm_float64(self, x):
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def _rope_float64(self, x, position_ids):
    freqs = position_ids[..., None].to(torch.float64) * self.exact_inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def make_hf_exact_float64(hf_model, inv_freq: list[float]) -> None:
    """Patches every RMSNorm and the rotary embedding of `hf_model` to compute in float64."""
    for module in hf_model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rmsnorm_float64, module)
    rotary = hf_model.model.rotary_emb
    rotary.exact_inv_freq = torch.tensor(inv_freq, dtype=torch.float64)
    rotary.forward = types.MethodType(_rope_float64, rotary)


@torch.no_grad()
def randomise_norms_and_biases(model) -> None:
    """HF starts norms at 1 and biases at 0: randomise them so a mis-wired one shows up."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1 + 0.2 * torch.randn_like(param))
        elif name.endswith("bias"):
            param.copy_(0.2 * torch.randn_like(param))


def build_tiny_hf(
    arch: str,
    seed: int = 0,
    tied: bool = False,
    vocab_size: int = 128,
    hidden_size: int = 64,
    head_dim: int = 16,
    num_kv_heads: int = 2,
):
    """A tiny random float64 HF model (2 layers, 4 heads, `num_kv_heads` KV heads)
    with randomised norms and biases, patched to exact float64. EOS is token 2."""
    config_cls, model_cls = HF_CLASSES[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch != "qwen2":  # Qwen2 derives head_dim from hidden_size / heads
        kwargs["head_dim"] = head_dim
    config = config_cls(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float64).eval()
    randomise_norms_and_biases(model)
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    rope_dim = hidden_size // 4 if arch == "qwen2" else head_dim
    make_hf_exact_float64(model, reference_inv_freq(rope_dim, theta, None))
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int, stop_ids: list[int] | None) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt (new tokens only)."""
    gen = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=stop_ids or None,
        pad_token_id=0,
    )
    out = model.generate(torch.tensor([prompt]), generation_config=gen)
    return out[0, len(prompt) :].tolist()
