"""LLMServingSim's measured operator times, as rows of servelab's cost terms.

LLMServingSim (github.com/casys-kaist/LLMServingSim, MIT licence) publishes two kinds of
profiles; nothing is downloaded, the readers take a local checkout.

**Bundles** (its profiler from v1.1.0 on: vLLM's own layers, timed inside vLLM) under
`profiler/perf/<GPU>/<org>/<model>/<variant>/`: a `meta.yaml` and per tensor-parallel
degree a folder `tp<N>/` (the ranks' shapes emulated on one GPU, so no collective is
in them) with
- `dense.csv` (`layer,tokens,time_us`): one call of each of one decoder layer's kernels
  on `tokens` new tokens: `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj` (matmuls),
  `act_fn` (SiLU x up), `rotary_emb`, `layernorm` (vLLM's RMSNorm with the residual add
  fused in), `final_layernorm`, `embedding`, and on Qwen3 `qk_norm`;
- `per_sequence.csv` (`layer,sequences,time_us`): `lm_head` and `sampler` on that many
  sequences' last tokens;
- `attention.csv` (`prefill_chunk,kv_prefill,n_decode,kv_decode,time_us`): one
  attention call over a prefill chunk of `prefill_chunk` tokens after `kv_prefill`
  cached ones and `n_decode` decodes of one token each after `kv_decode` cached ones
  (either part may be absent);
- `moe.csv`, `skew.csv`, `skew_fit.csv` (not read: servelab has no MoE layers, and
  prices a decode batch by its keys in all).
Layers the writer copies from `tp1/` into the other degrees (the norms) are read once.
The model's shape comes from the checkout's `configs/model/<org>/<model>.json` (its
Hugging Face config). Each kernel becomes the cost model's op for it (`layernorm`: an
RMSNorm and a residual add, priced as their sum; an attention row: the step's
attention ops, prefill and decode, priced as their sum). Not read: `embedding` (a
gather the cost model prices at its bytes), `qk_norm` (not in the cost model),
`sampler` (vLLM's sampler does far more than read the logits, which is what the cost
model prices).

**v0 profiles** (up to v1.1.0, kept at `profiler/v0/perf_models` after it; earlier at
`llm_profile/perf_models`): `<GPU>/<org>/<model>/tp<N>/attention.csv`, attention times
measured with FlashAttention-2's varlen kernel in Vidur's column format with one
difference of meaning: `kv_cache_size` is a prefill chunk's whole context (the chunk
included) and a decode batch's keys in all, split evenly over its sequences
(`vidur_data.read_attention` with `kv_total`). On the H100: Llama-3.1-70B and
Mixtral-8x7B at TP 4.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from servelab.errors import ConfigError
from servelab.executor.cost_model import (
    CostModel,
    Op,
    Shape,
    StepShape,
    matmul_op,
    residual_rereads,
)
from servelab.executor.hardware import HardwareProfile
from servelab.lab.vidur_data import (
    BYTES,
    DTYPE,
    MeasuredOps,
    device_folder,
    linear_and_elementwise_ops,
    read_attention,
)

US = 1e-6
# servelab's profiles -> LLMServingSim's device folders (v0 perf_models or bundles)
LLMSERVINGSIM_GPUS = {"h100-sxm": "H100", "rtx-pro-6000": "RTXPRO6000"}
# dense.csv's layers -> the ops (Vidur's names in `linear_and_elementwise_ops`) each is
DENSE = {
    "qkv_proj": ("attn_pre_proj",),
    "o_proj": ("attn_post_proj",),
    "gate_up_proj": ("mlp_up_proj",),
    "down_proj": ("mlp_down_proj",),
    "rotary_emb": ("attn_rope",),
    "act_fn": ("mlp_act",),
    "layernorm": ("input_layernorm", "add"),  # vLLM's fused add + RMSNorm
    "final_layernorm": ("input_layernorm", "add"),
}
# the norms' residual reads after L2 traffic (`cost_model.residual_rereads`): the profiler
# runs one decoder layer, so a `layernorm` row is the mean of its first, plain RMSNorm and
# the post-attention add + RMSNorm (half its calls read a residual written before the qkv
# and o weights streamed); `final_layernorm` reads the one written before the MLP's
STALE = {"layernorm": (0.5, "attention"), "final_layernorm": (1.0, "mlp")}
SKIPPED = ("embedding", "qk_norm", "sampler")
# attention kernels, as the cost model's figures that say how a kernel's calls are built
# (`attention_gqa_packing`, `attention_unified`); a fit of measured attention tries each
KERNELS: dict[str, dict[str, float]] = {
    "fa2-varlen": {"attention_gqa_packing": 0.0, "attention_unified": 0.0},
    "vllm-fa2": {"attention_gqa_packing": 1.0, "attention_unified": 1.0},
    "fa3": {"attention_gqa_packing": 2.0, "attention_unified": 1.0},
}
Kernel = Mapping[str, float] | None


def kernel_profile(kernel: Kernel = None) -> HardwareProfile:
    """A profile of no speed whose attention figures build the `kernel`'s calls (and the
    paged kernel's block counts, `attention_sms`: priced where a profile names its SMs)."""
    return HardwareProfile("shape-only", 1, {DTYPE: 1.0}, 1.0, attention_sms=1.0,
                           **dict(kernel or {}))  # fmt: skip


def perf_dir(root: Path) -> Path:
    """The v0 `perf_models` folder under `root` (a checkout, its llm_profile, or itself)."""
    root = Path(root)
    for candidate in (root / "profiler" / "v0" / "perf_models", root / "llm_profile" / "perf_models",
                      root / "perf_models", root):  # fmt: skip
        if candidate.is_dir() and any(candidate.glob("*/*/*/*/attention.csv")):
            return candidate
    return root


def bundle_dir(root: Path) -> Path | None:
    """The bundles' folder under `root` (a checkout's `profiler/perf`, or itself), or None."""
    root = Path(root)
    for candidate in (root / "profiler" / "perf", root / "perf", root):
        if candidate.is_dir() and any(candidate.glob("*/*/*/*/tp*/*.csv")):
            return candidate
    return None


def model_shape(config: Path) -> Shape:
    """A decoder's shape from its Hugging Face config.json."""
    c = json.loads(Path(config).read_text())
    heads = int(c["num_attention_heads"])
    return Shape(
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c.get("intermediate_size") or 0),
        num_layers=int(c.get("num_hidden_layers") or 1),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
        vocab_size=int(c["vocab_size"]),
    )


def _times(path: Path, key: str) -> dict[str, dict[float, float]]:
    """layer -> {size: seconds} of a dense.csv or per_sequence.csv."""
    out: dict[str, dict[float, float]] = defaultdict(dict)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            out[row["layer"]][float(row[key])] = float(row["time_us"]) * US
    return out


def moe_traffic(config: Path) -> tuple[float, float] | None:
    """An MoE model's (routed experts per token, expert intermediate size) from its
    config.json, or None for a dense model."""
    c = json.loads(Path(config).read_text())
    if not c.get("num_experts_per_tok") or not c.get("moe_intermediate_size"):
        return None
    return float(c["num_experts_per_tok"]), float(c["moe_intermediate_size"])


def dense_ops(shape: Shape, tp: int, layer: str, tokens: float,
              moe: tuple[float, float] | None = None) -> list[Op]:  # fmt: skip
    """The cost model's ops for one call of a dense.csv layer on `tokens` tokens (a fused
    kernel's ops after the first add no launch of their own)."""
    ops = linear_and_elementwise_ops(shape, tp, tokens)
    first, *fused = (ops[name] for name in DENSE[layer])
    out = [first, *(dataclasses.replace(op, launches=0.0) for op in fused)]
    if layer in STALE:  # the fused norm's residual, read after a block's weights streamed
        share, block = STALE[layer]
        out += residual_rereads(shape, tp, tokens, BYTES, share, (block,))
        if moe is not None and block == "mlp":  # the MoE block's traffic instead: every
            # token routed alike (one prompt id), `k` experts' weights; a token's norm output,
            # its k copies in, their gate_up, activation and down outputs, the combined output
            k, inter, h, e = moe[0], moe[1] / tp, shape.hidden_size, BYTES
            behind = e * (3 * k * h * inter + tokens * (2 * h + k * (2 * h + 3 * inter)))
            out[-1] = dataclasses.replace(out[-1], behind=behind)
    return out


def attention_ops(shape: Shape, tp: int, chunk: float, cached: float, decodes: int,
                  history: float, kernel: Kernel = None) -> list[Op]:  # fmt: skip
    """The cost model's attention ops for one row of a bundle's attention.csv: a prefill
    chunk of `chunk` tokens after `cached`, beside `decodes` one-token decodes after
    `history` cached tokens each (their keys: history + 1), for the `kernel`."""
    prefill = np.array([chunk]) if chunk else np.zeros(0)
    start = np.array([cached]) if chunk else np.zeros(0)
    step = StepShape(prefill, start, np.full(decodes, history + 1.0), decodes + (1 if chunk else 0))
    return _cost_model(shape, tp, tuple(sorted(dict(kernel or {}).items()))).attention_ops(step)


@functools.lru_cache(maxsize=64)
def _cost_model(shape: Shape, tp: int, kernel: tuple) -> CostModel:
    return CostModel(shape, kernel_profile(dict(kernel)), DTYPE, BYTES, tp)


def read_bundle(folder: Path, shape: Shape, measured: MeasuredOps, model: str,
                kernel: Kernel = None, attention: bool | None = None,
                moe: tuple[float, float] | None = None) -> dict[str, int]:  # fmt: skip
    """Adds one bundle's rows (every tp<N>/ under `folder`, a `<variant>` folder; with
    `attention` True or False only attention.csv's or only the others'); the rows kept
    by file kind."""
    kept: dict[str, int] = defaultdict(int)
    tps = sorted((int(p.name[2:]), p) for p in folder.glob("tp*") if p.name[2:].isdigit())
    first: dict[str, dict[str, dict[float, float]]] = {}
    for tp, path in tps:
        for kind, key in (("dense", "tokens"), ("per_sequence", "sequences")):
            file = path / f"{kind}.csv"
            if not file.is_file() or attention:
                continue
            table = _times(file, key)
            first.setdefault(kind, table)
            for layer, times in table.items():
                if layer in SKIPPED or (tp != tps[0][0] and times == first[kind].get(layer)):
                    continue  # not priced, or copied from the first degree's folder
                for size, seconds in times.items():
                    if layer == "lm_head":
                        h, vocab = shape.hidden_size, shape.vocab_size / tp
                        ops = [matmul_op("lm_head", size, h, vocab, BYTES)]
                    elif layer in DENSE:
                        ops = dense_ops(shape, tp, layer, size, moe)
                    else:
                        continue
                    measured.add_group(ops, model, tp, size, seconds, str(file), layer)
                    kept[kind] += 1
        file = path / "attention.csv"
        if file.is_file() and attention is not False:
            kept["attention"] += read_bundle_attention(file, shape, tp, measured, model, kernel)
    return dict(kept)


def read_bundle_attention(path: Path, shape: Shape, tp: int, measured: MeasuredOps, model: str,
                          kernel: Kernel = None) -> int:  # fmt: skip
    """Adds one bundle attention.csv's rows, labelled prefill, decode or mixed (the
    measurement's tokens: the chunk's and the decodes')."""
    kept = 0
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            chunk, cached = float(row["prefill_chunk"]), float(row["kv_prefill"])
            decodes, history = int(row["n_decode"]), float(row["kv_decode"])
            if not chunk and not decodes:
                continue
            ops = attention_ops(shape, tp, chunk, cached, decodes, history, kernel)
            label = "mixed" if chunk and decodes else ("prefill" if chunk else "decode")
            seconds = float(row["time_us"]) * US
            measured.add_group(ops, model, tp, chunk + decodes, seconds, str(path), label)
            kept += 1
    return kept


def read_bundles(root: Path, gpu: str, configs: Path | None = None, variant: str = "bf16",
                 kernel: Kernel = None, attention: bool | None = None,
                 empty: bool = False) -> MeasuredOps:  # fmt: skip
    """Every model's bundle of `variant` under `<bundles>/<gpu>/`, each model's shape from
    `configs` (default: the checkout's configs/model) by its `<org>/<model>` folders
    (`attention`: as `read_bundle`; `empty`: no rows is no error)."""
    base = bundle_dir(root)
    if base is None:
        raise ConfigError(f"no LLMServingSim profile bundles under {root} (expected "
                          f"profiler/perf/<GPU>/<org>/<model>/<variant>/tp<N>/dense.csv)")  # fmt: skip
    folder = device_folder(base, gpu, "LLMServingSim profile bundles",
                           "<dir>/<GPU>/<org>/<model>/<variant>/tp<N>/dense.csv")  # fmt: skip
    configs = Path(configs) if configs else _configs_of(Path(root), base)
    measured = MeasuredOps()
    for bundle in sorted(folder.glob(f"*/*/{variant}")):
        name = str(bundle.parent.relative_to(folder))
        config = configs / f"{name}.json"
        if not config.is_file():
            raise ConfigError(f"no model config for {name} at {config} (the checkout's "
                              f"configs/model; or pass the folder of <org>/<model>.json)")  # fmt: skip
        read_bundle(bundle, model_shape(config), measured, name, kernel, attention,
                    moe_traffic(config))  # fmt: skip
    if not len(measured) and not empty:
        raise ConfigError(f"no {variant} bundle rows under {folder}")
    return measured


def _configs_of(root: Path, base: Path) -> Path:
    """The checkout's configs/model, looked for above the bundles' folder."""
    for candidate in (root / "configs" / "model", base.parent.parent / "configs" / "model",
                      base.parent / "configs" / "model"):  # fmt: skip
        if candidate.is_dir():
            return candidate
    return root / "configs" / "model"


def has_bundles(root: Path, gpu: str) -> bool:
    base = bundle_dir(root)
    return base is not None and (base / gpu).is_dir()


def read_llmservingsim(root: Path, gpu: str, kernel: Kernel = None) -> MeasuredOps:
    """Every model's v0 attention.csv under `perf_models/<gpu>/`, the model named
    `<org>/<model>/tp<N>` as the folders say, its rows the `kernel`'s ops."""
    folder = device_folder(
        perf_dir(root), gpu, "LLMServingSim profiles",
        "<dir>/<GPU>/<org>/<model>/tp<N>/attention.csv, e.g. profiler/v0/perf_models",
    )  # fmt: skip
    measured = MeasuredOps()
    for path in sorted(folder.rglob("attention.csv")):
        if path.parent.name.startswith("tp"):
            read_attention(path, measured, str(path.parent.relative_to(folder)), kv_total=True,
                           kernel=kernel_profile(kernel))  # fmt: skip
    if not len(measured):
        raise ConfigError(f"no attention.csv rows under {folder}")
    return measured
