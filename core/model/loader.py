"""Builds a `Transformer` from a named shape (seeded random weights) or from a
Hugging Face checkpoint folder (config.json + safetensors, single or sharded).

Rules:
- random weights are a function of (shape, seed) only: drawn in float32 from a
  CPU `torch.Generator`, then cast, so every dtype and device gets the same values;
- a checkpoint must provide exactly the model's tensors: missing, unexpected or
  misshapen tensors are one `ConfigError` naming them (a tied model may carry a
  redundant `lm_head.weight`; RoPE `inv_freq` buffers of old checkpoints are ignored);
- the tokenizer is `tokenizer.json` read with `tokenizers` when present, else None
  (a named shape: the tiny shapes' own, `servelab.model.tiny_tokenizer`, else None);
- with a tensor-parallel `Shard`, the model is built with the rank's heads and
  MLP width and each tensor is read as the rank's slice only (safetensors'
  `get_slice`); random weights are drawn whole, then sliced, so every rank
  holds its part of the same model.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from servelab.errors import ConfigError
from servelab.model.config import NAMED_SHAPES, ModelConfig, named_config, resolve_dtype
from servelab.model.sharding import Shard
from servelab.model.tiny_tokenizer import named_tokenizer
from servelab.model.transformer import Transformer

__all__ = [
    "load_model",
    "load_shape",
    "model_source",
    "resolve_dtype",
    "init_random_weights",
    "load_checkpoint_weights",
]

INIT_STD = 0.02  # like HF's initializer_range
NORM_JITTER = 0.05  # norm weights are 1 + small noise, so a wrong norm wiring shows up

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def model_source(node: Any) -> str:
    """A model node is a name or path string, or `{name: ..., path: ...}` (path wins)."""
    if isinstance(node, str):
        return node
    if isinstance(node, Mapping):
        unknown = set(node) - {"name", "path"}
        if unknown:
            raise ConfigError(f"unknown model option(s) {sorted(unknown)}; accepted: name, path")
        source = node.get("path") or node.get("name")
        if source:
            return str(source)
    raise ConfigError(
        f"model must be a named shape, a checkpoint folder or {{name, path}}; got {node!r}"
    )


def load_shape(source: str) -> ModelConfig:
    """The model's shape alone (no weights): a named shape or a folder's config.json."""
    if source in NAMED_SHAPES:
        return named_config(source)
    folder = Path(source)
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"model {source!r} is neither a named shape ({', '.join(NAMED_SHAPES)}) "
            "nor a checkpoint folder holding config.json"
        )
    return read_config(folder / "config.json")


def load_model(
    source: str,
    dtype: str | torch.dtype = "float32",
    device: torch.device | str = "cpu",
    seed: int = 0,
    shard: tuple[int, int] | None = None,
) -> tuple[Transformer, ModelConfig, Any]:
    """`source` is a named shape (see `NAMED_SHAPES`) or a checkpoint folder;
    `shard` is `(rank, size)` of a tensor-parallel group (None: the whole model).
    Returns (model in eval mode, the whole model's config, tokenizer or None)."""
    torch_dtype = resolve_dtype(dtype)
    config = load_shape(source)
    part = None if shard is None else Shard(config, *shard)
    local = config if part is None else part.local_config
    model = Transformer(local, torch_dtype, device, None if part is None else part.vocab_start)
    if source in NAMED_SHAPES:
        init_random_weights(model, seed, part)
        return model.eval().requires_grad_(False), config, named_tokenizer(source)
    folder = Path(source)
    load_checkpoint_weights(model, folder, part)
    return model.eval().requires_grad_(False), config, load_tokenizer(folder)


@torch.no_grad()
def init_random_weights(model: Transformer, seed: int, shard: Shard | None = None) -> None:
    """N(0, INIT_STD) for linear, bias and embedding weights; 1 + N(0, NORM_JITTER)
    for norm weights. Deterministic in (parameter names and shapes, seed); a
    shard draws the whole tensors and keeps its slices."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        shape = tuple(param.shape) if shard is None else shard.full_shape(name, param.shape)
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            values = 1.0 + NORM_JITTER * values
        else:
            values = INIT_STD * values
        param.copy_(_shard_of(values, name, shard))


def _shard_of(values: torch.Tensor, name: str, shard: Shard | None) -> torch.Tensor:
    """`values` (the whole tensor), or the part `shard` holds of it."""
    if shard is None:
        return values
    if shard.is_zeroed(name):
        return torch.zeros_like(values)
    index = shard.slices(name, tuple(values.shape))
    return values if index is None else shard.fit(name, values[index])


def checkpoint_files(folder: Path) -> dict[Path, list[str]]:
    """Shard file -> tensor names it holds, from the index when sharded."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index}: no weight_map object (a sharded checkpoint's index)")
        shards: dict[Path, list[str]] = defaultdict(list)
        for name, shard in weight_map.items():
            shards[folder / shard].append(name)
        return dict(shards)
    single = folder / SINGLE_FILE
    if single.is_file():
        with open_safetensors(single) as f:
            return {single: list(f.keys())}
    raise ConfigError(f"checkpoint folder {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def read_json(path: Path) -> dict:
    """A JSON object from `path`; a ConfigError naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_config(path: Path) -> ModelConfig:
    """The model config of a checkpoint's config.json; every problem names the file."""
    try:
        return ModelConfig.from_hf_dict(read_json(path))
    except ConfigError as err:
        raise ConfigError(str(err) if str(path) in str(err) else f"{path}: {err}") from None
    except (KeyError, TypeError, ValueError) as err:  # a missing or mistyped field
        raise ConfigError(
            f"{path}: missing or malformed field ({type(err).__name__}: {err})"
        ) from None


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """`safe_open`, with a file that is not safetensors (truncated, corrupted) a
    ConfigError naming it."""
    try:
        handle = safe_open(path, framework="pt")
    except Exception as err:  # safetensors' SafetensorError, an OSError
        raise ConfigError(f"{path}: not a readable safetensors file ({err})") from None
    with handle as f:
        yield f


def _is_ignored(name: str, model: Transformer) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return name == "lm_head.weight" and model.lm_head is None


@torch.no_grad()
def load_checkpoint_weights(
    model: Transformer, folder: Path | str, part: Shard | None = None
) -> None:
    """Copies every tensor of the checkpoint into the parameter of the same name
    (with `part`, only the rank's slice of it is read)."""
    folder = Path(folder)
    params = dict(model.named_parameters())
    shards = checkpoint_files(folder)
    names = [n for names in shards.values() for n in names if not _is_ignored(n, model)]
    missing = sorted(set(params) - set(names))
    unexpected = sorted(set(names) - set(params))
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {folder} does not match the {model.config.architecture} model: "
            f"missing tensors: {', '.join(missing) or 'none'}; "
            f"unexpected tensors: {', '.join(unexpected) or 'none'}"
        )
    for shard_file, shard_names in shards.items():
        if not shard_file.is_file():
            raise ConfigError(
                f"checkpoint shard {shard_file} listed in {INDEX_FILE} does not exist"
            )
        with open_safetensors(shard_file) as f:
            for name in shard_names:
                if _is_ignored(name, model):
                    continue
                try:
                    tensor = _read_tensor(f, name, part)
                except Exception as err:  # a truncated or corrupted file
                    raise ConfigError(f"{shard_file}: cannot read tensor {name} ({err})") from None
                param = params[name]
                if tensor.shape != param.shape:
                    raise ConfigError(
                        f"tensor {name}: checkpoint shape {tuple(tensor.shape)}, "
                        f"model expects {tuple(param.shape)}"
                        + ("" if part is None else f" on rank {part.rank} of {part.size}")
                    )
                param.copy_(tensor)


def _read_tensor(f: Any, name: str, shard: Shard | None) -> torch.Tensor:
    """Tensor `name` of an open safetensors file, or only `shard`'s slice of it."""
    if shard is None:
        return f.get_tensor(name)
    view = f.get_slice(name)
    full_shape = tuple(view.get_shape())
    if shard.is_zeroed(name):
        return torch.zeros(full_shape)  # copied into the parameter's dtype
    index = shard.slices(name, full_shape)
    if index is None:
        return f.get_tensor(name)
    return shard.fit(name, view[index])


def load_tokenizer(folder: Path):
    """`tokenizers.Tokenizer` from tokenizer.json, or None when the folder has none."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own Exception type
        raise ConfigError(f"{path}: not a readable tokenizer ({err})") from None
