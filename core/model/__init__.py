"""The decoder (Qwen3 / Qwen2 / Llama), its loader and the sampler.

`load_model(source, dtype, device, seed)` builds a model from a named shape or a
Hugging Face checkpoint folder; `Sampler().sample(...)` turns logits into tokens.
"""

from servelab.model.config import NAMED_SHAPES, ModelConfig, named_config, resolve_dtype
from servelab.model.loader import load_model
from servelab.model.sampler import Sampler
from servelab.model.transformer import Transformer

__all__ = [
    "NAMED_SHAPES",
    "ModelConfig",
    "Sampler",
    "Transformer",
    "load_model",
    "named_config",
    "resolve_dtype",
]
