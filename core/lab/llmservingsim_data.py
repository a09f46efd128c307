"""LLMServingSim's measured attention times, as rows of servelab's attention cost terms.

LLMServingSim (github.com/casys-kaist/LLMServingSim, MIT licence) published, up to its
v1.1.0 release, attention times measured with FlashAttention-2's varlen kernel under its
`llm_profile/perf_models/<GPU>/<org>/<model>/tp<N>/attention.csv` (H100: Llama-3.1-70B
and Mixtral-8x7B at TP 4), in Vidur's column format with one difference of meaning:
`kv_cache_size` is a prefill chunk's whole context (the chunk included) and a decode
batch's keys in all, split evenly over its sequences (`vidur_data.read_attention`
with `kv_total`). Nothing is downloaded: the reader takes a local copy (a checkout of
such a commit, its `llm_profile` or its `perf_models`).
"""

from __future__ import annotations

from pathlib import Path

from servelab.errors import ConfigError
from servelab.lab.vidur_data import MeasuredOps, device_folder, read_attention

# servelab's profiles -> LLMServingSim's device folders
LLMSERVINGSIM_GPUS = {"h100-sxm": "H100"}


def perf_dir(root: Path) -> Path:
    """The `perf_models` folder under `root` (a checkout, its llm_profile, or itself)."""
    root = Path(root)
    for candidate in (root / "llm_profile" / "perf_models", root / "perf_models", root):
        if candidate.is_dir() and any(candidate.glob("*/*/*/*/attention.csv")):
            return candidate
    return root


def read_llmservingsim(root: Path, gpu: str) -> MeasuredOps:
    """Every model's attention.csv under `perf_models/<gpu>/`, the model named
    `<org>/<model>/tp<N>` as the folders say."""
    folder = device_folder(
        perf_dir(root), gpu, "LLMServingSim profiles",
        "<dir>/<GPU>/<org>/<model>/tp<N>/attention.csv, e.g. llm_profile/perf_models",
    )  # fmt: skip
    measured = MeasuredOps()
    for path in sorted(folder.rglob("attention.csv")):
        read_attention(path, measured, str(path.parent.relative_to(folder)), kv_total=True)
    if not len(measured):
        raise ConfigError(f"no attention.csv rows under {folder}")
    return measured
