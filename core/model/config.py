"""The decoder's shape (`ModelConfig`), read from a Hugging Face `config.json` or
picked by name from `NAMED_SHAPES`, and the dtype names servelab accepts.

Rules:
- one config covers Qwen3 (q/k RMSNorm), Qwen2 (bias on q/k/v) and Llama;
- RoPE is "default" (`rope_scaling is None`) or Llama 3.1's "llama3" scaling;
  anything else is a `ConfigError` naming the supported types;
- every error lists the valid choices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from servelab.errors import ConfigError

ARCHITECTURES = ("qwen3", "qwen2", "llama")
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"float64" | "float32" | "bfloat16" | "float16"` (or `"torch.float32"`,
    or one of those torch dtypes) -> the torch dtype; anything else is a ConfigError."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ConfigError(f"unsupported dtype {dtype!r}; valid dtypes: {', '.join(DTYPES)}")


@dataclass
class ModelConfig:
    """Shape and numerics of one decoder. Field names follow servelab, not HF;
    `from_hf_dict` does the translation."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = (
        None  # None = default RoPE; else {"rope_type": "llama3", ...}
    )
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before RoPE
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama/Qwen3 `attention_bias`)
    o_proj_bias: bool = False  # Llama/Qwen3 `attention_bias` also puts a bias on o_proj
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)
        self.eos_token_ids = list(self.eos_token_ids)

    # -- derived figures
    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        """Softmax scale every attention backend gets: 1 / sqrt(head_dim)."""
        return self.head_dim**-0.5

    def kv_bytes_per_token(self, dtype: str | torch.dtype) -> int:
        """Bytes of K and V, all layers, for one token."""
        itemsize = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # -- Hugging Face config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Reads a HF `config.json` dict (model_type qwen3, qwen2 or llama; both the
        transformers 4 `rope_theta`/`rope_scaling` keys and the 5.x `rope_parameters`)."""
        arch = d.get("model_type")
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"unsupported model_type {arch!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        _reject_unsupported_features(d)
        num_heads = d["num_attention_heads"]
        # HF's Qwen3Config defaults head_dim to 128; the others derive it.
        default_head_dim = 128 if arch == "qwen3" else d["hidden_size"] // num_heads
        bias = bool(d.get("attention_bias", False))
        rope_theta, rope_scaling = _read_rope(d)
        eos = d.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or default_head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=arch == "qwen3",
            attention_bias=True if arch == "qwen2" else bias,
            o_proj_bias=False if arch == "qwen2" else bias,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            bos_token_id=d.get("bos_token_id"),
        )


def _read_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config.json layout."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return float(params.get("rope_theta", d.get("rope_theta", 10000.0))), scaling
    return float(d.get("rope_theta", 10000.0)), d.get("rope_scaling")


def _normalise_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """None for plain RoPE, else a llama3 dict with every key it needs."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ConfigError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"llama3 rope_scaling lacks {', '.join(missing)}")
    return {"rope_type": "llama3", **{k: scaling[k] for k in LLAMA3_ROPE_KEYS}}


def _reject_unsupported_features(d: dict[str, Any]) -> None:
    """Fail loudly on HF options this decoder does not implement."""
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {d['hidden_act']!r}; supported: silu")
    if d.get("mlp_bias"):
        raise ConfigError("unsupported mlp_bias=true; the MLP projections have no bias")
    if d.get("use_sliding_window"):
        raise ConfigError("unsupported use_sliding_window=true; only full attention is implemented")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("unsupported partial_rotary_factor; RoPE spans the whole head_dim")


# -- named shapes (random weights from a seed; see loader.load_model)
_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    eos_token_ids=[1],
)

NAMED_SHAPES: dict[str, ModelConfig] = {
    # the default embedded model the CLI runs
    "tiny": ModelConfig(architecture="qwen3", qk_norm=True, **_TINY),
    "tiny-llama": ModelConfig(architecture="llama", tie_word_embeddings=True, **_TINY),
    "tiny-qwen2": ModelConfig(architecture="qwen2", attention_bias=True, **_TINY),
    "bench": ModelConfig(
        architecture="qwen3",
        qk_norm=True,
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        eos_token_ids=[1],
    ),
    # the real Qwen3-0.6B shape (its config.json / generation_config.json)
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3",
        qk_norm=True,
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        eos_token_ids=[151645, 151643],
        bos_token_id=151643,
    ),
    # the shapes of published checkpoints (Hugging Face config.json), for the
    # simulated executor; the real one would give them random weights
    "qwen3-8b": ModelConfig(
        architecture="qwen3",
        qk_norm=True,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        eos_token_ids=[151645, 151643],
        bos_token_id=151643,
    ),
    "qwen3-32b": ModelConfig(
        architecture="qwen3",
        qk_norm=True,
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_layers=64,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        eos_token_ids=[151645, 151643],
        bos_token_id=151643,
    ),
    "llama3-8b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        eos_token_ids=[128001, 128009],
        bos_token_id=128000,
    ),
    "llama3-70b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        eos_token_ids=[128001, 128009],
        bos_token_id=128000,
    ),
}


def named_config(name: str) -> ModelConfig:
    """A copy of the named shape; unknown names are a ConfigError listing them."""
    if name not in NAMED_SHAPES:
        raise ConfigError(f"unknown model shape {name!r}; named shapes: {', '.join(NAMED_SHAPES)}")
    return NAMED_SHAPES[name].replace()
