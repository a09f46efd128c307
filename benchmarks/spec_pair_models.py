"""The trained pair's networks in plain torch, for training: a Qwen3 decoder and
an EAGLE-style head, with Hugging Face's tensor names and numerics.

Why a second decoder: servelab's `Transformer` is an inference module (its
q/k/v and gate/up weights are views of fused tensors created without
gradients, and it attends through a paged-cache backend), so training runs
here. The ops mirror servelab's op by op (fused float32 RMSNorm, per-head q/k
norm before rotate-half RoPE from float64 tables, SiLU gate, tied LM head), so
`servelab.model.loader.load_model` reads the saved folder and gives the same
logits to rounding; `spec_pair.py verify` checks it.

The EAGLE head (EAGLE-1, Li et al. 2024) predicts the target's next feature.
Features are the target's final hidden states after its final RMSNorm (what
its LM head reads). For head position t = 0 .. T-2 of a sequence x_0 .. x_{T-1}:

    input_t = fc(concat(embed_target(x_{t+1}), f_t))   # f_t: feature at position t
    h_{t+1} = layer(input_t)    # one Qwen3 decoder layer, RoPE at position t + 1,
                                # causal over head positions 0 .. t
    logits  = lm_head_target(h_{t+1})     # predicts x_{t+2}; no final norm

Training targets: h_{t+1} ~ f_{t+1} (smooth L1) and logits -> x_{t+2}
(cross-entropy). The head stores `fc.weight` and `layer.*`; the embeddings and
the LM head are the target's.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-6
INIT_STD = 0.02
EAGLE_ARCHITECTURE = "ServelabEagleHead"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class Shape:
    """One Qwen3 decoder's size (HF `config.json` names in `hf_config`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 1024

    def hf_config(self, eos_token_id: int) -> dict:
        """The `config.json` of a tied-embedding Qwen3 checkpoint of this shape."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": RMS_NORM_EPS,
            "rope_theta": ROPE_THETA,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": eos_token_id,
            "eos_token_id": eos_token_id,
            "torch_dtype": "float32",
        }


def rope_tables(head_dim: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, head_dim / 2] in float32, computed in float64 as servelab does."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [B, heads, T, D] with cos/sin [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], None, RMS_NORM_EPS) * self.weight


class Attention(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        hidden, d = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, d
        self.q_proj = nn.Linear(hidden, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, hidden, bias=False)
        self.q_norm = RMSNorm(d)
        self.k_norm = RMSNorm(d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        hidden, inner = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """HF's `model.` prefix."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size)


class Qwen3(nn.Module):
    """A tied-embedding Qwen3 over a batch of whole sequences [B, T] from position 0."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.shape = shape
        self.model = DecoderStack(shape)
        cos, sin = rope_tables(shape.head_dim, shape.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states after the final norm [B, T, hidden]: the EAGLE features."""
        length = input_ids.shape[1]
        cos, sin = self.rope_cos[:length], self.rope_sin[:length]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def lm_head(self, features: torch.Tensor) -> torch.Tensor:
        return F.linear(features, self.model.embed_tokens.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.features(input_ids))


class EagleHead(nn.Module):
    """fc + one Qwen3 decoder layer; see the module docstring for positions."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(2 * shape.hidden_size, shape.hidden_size, bias=False)
        self.layer = DecoderLayer(shape)
        cos, sin = rope_tables(shape.head_dim, shape.max_position_embeddings + 1)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, next_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """next_embeds [B, T, H] = embed(x_{t+1}), features [B, T, H] = f_t, for
        head positions t = 0 .. T-1 -> predicted features h_{t+1} [B, T, H]."""
        length = features.shape[1]
        cos, sin = self.rope_cos[1 : length + 1], self.rope_sin[1 : length + 1]
        return self.layer(self.fc(torch.cat((next_embeds, features), dim=-1)), cos, sin)

    def config(self, target_folder: str) -> dict:
        """config.json of the head's folder; `target_folder` relative to it."""
        shape = self.shape
        return {
            "architectures": [EAGLE_ARCHITECTURE],
            "hidden_size": shape.hidden_size,
            "num_attention_heads": shape.num_heads,
            "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "intermediate_size": shape.intermediate_size,
            "rms_norm_eps": RMS_NORM_EPS,
            "rope_theta": ROPE_THETA,
            "target": target_folder,
        }


@torch.no_grad()
def init_weights(module: nn.Module, generator: torch.Generator) -> None:
    """N(0, INIT_STD) for matrices and embeddings (output projections scaled by
    1/sqrt(2 * layers), as GPT-2 does), ones for norms; in parameter order."""
    num_layers = getattr(getattr(module, "shape", None), "num_layers", 1)
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        std = INIT_STD
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= (2 * num_layers) ** 0.5
        param.copy_(torch.randn(param.shape, generator=generator) * std)


def _save_tensors(module: nn.Module, path: Path) -> None:
    tensors = {name: p.detach().contiguous().clone() for name, p in module.named_parameters()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def save_qwen3(
    model: Qwen3, folder: Path, tokenizer_json: str, eos_token: str, eos_id: int
) -> None:
    """A Hugging Face Qwen3 checkpoint folder: config.json, generation_config.json,
    model.safetensors (no lm_head: tied), tokenizer.json, tokenizer_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", model.shape.hf_config(eos_id))
    _write_json(
        folder / "generation_config.json",
        {"bos_token_id": eos_id, "eos_token_id": eos_id, "do_sample": False},
    )
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": eos_token,
            "bos_token": eos_token,
            "model_max_length": model.shape.max_position_embeddings,
        },
    )
    _save_tensors(model, folder / WEIGHTS_FILE)


def load_qwen3(folder: Path) -> Qwen3:
    """A checkpoint written by `save_qwen3`, back as a training-code model (eval mode)."""
    config = json.loads((folder / "config.json").read_text())
    shape = Shape(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        max_position_embeddings=config["max_position_embeddings"],
    )
    model = Qwen3(shape)
    model.load_state_dict(load_file(str(folder / WEIGHTS_FILE)), strict=True)
    return model.eval().requires_grad_(False)


def save_eagle(head: EagleHead, folder: Path, target_folder: str) -> None:
    """config.json (architectures ServelabEagleHead) and model.safetensors
    (`fc.weight`, `layer.*`)."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "config.json", head.config(target_folder))
    _save_tensors(head, folder / WEIGHTS_FILE)


def load_eagle(folder: Path, target: Qwen3) -> EagleHead:
    """An EAGLE head folder; its shape is the declared config with the target's vocabulary."""
    config = json.loads((folder / "config.json").read_text())
    shape = dataclasses.replace(
        target.shape,
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=1,
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
    )
    head = EagleHead(shape)
    head.load_state_dict(load_file(str(folder / WEIGHTS_FILE)), strict=True)
    return head.eval().requires_grad_(False)


def eagle_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor an EAGLE head folder declares by its config.json, with its shape."""
    hidden, inner, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    return {
        "fc.weight": (hidden, 2 * hidden),
        "layer.self_attn.q_proj.weight": (heads * d, hidden),
        "layer.self_attn.k_proj.weight": (kv_heads * d, hidden),
        "layer.self_attn.v_proj.weight": (kv_heads * d, hidden),
        "layer.self_attn.o_proj.weight": (hidden, heads * d),
        "layer.self_attn.q_norm.weight": (d,),
        "layer.self_attn.k_norm.weight": (d,),
        "layer.mlp.gate_proj.weight": (inner, hidden),
        "layer.mlp.up_proj.weight": (inner, hidden),
        "layer.mlp.down_proj.weight": (hidden, inner),
        "layer.input_layernorm.weight": (hidden,),
        "layer.post_attention_layernorm.weight": (hidden,),
    }


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")
