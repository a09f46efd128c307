"""A trained small model pair for speculative decoding: a Qwen3 target, a
smaller Qwen3 draft and an EAGLE-style head, trained from a seed on the Python
standard library's own source (every machine has it offline), with their own
byte-level BPE tokenizer. Random weights make any acceptance rate meaningless;
these make it a property of real (if small) language models.

    python benchmarks/spec_pair.py train [--quick] [--out DIR] [--seed N]
    python benchmarks/spec_pair.py verify   [--quick] [--out DIR] [--seed N]
    python benchmarks/spec_pair.py evaluate [--quick] [--out DIR] [--seed N]

`train` builds the run folder unless it is already complete (then it reuses
it); `verify` and `evaluate` train first when needed. The folder is
`~/.cache/servelab/spec_pair/<digest>` (the digest of the seed, the settings,
`SCRIPT_VERSION` and the Python, torch and tokenizers versions), or `--out`:

    manifest.json        settings, seed, digest, parameter counts, held-out
                         figures, wall times, sha256 of every weight file and
                         of the workloads (rewritten, without retraining, when
                         their code's `WORKLOADS_VERSION` changes)
    target/, draft/      Hugging Face Qwen3 checkpoints (config.json,
                         model.safetensors, tokenizer.json, tokenizer_config.json,
                         generation_config.json), `load_model(path)` reads them
    eagle/               config.json {"architectures": ["ServelabEagleHead"],
                         hidden_size, num_attention_heads, num_key_value_heads,
                         head_dim, intermediate_size, rms_norm_eps, rope_theta,
                         "target": "../target"} and model.safetensors with
                         `fc.weight` [H, 2H] and `layer.<Qwen3 layer tensor>`
                         (see spec_pair_models.py for what each position reads)
    workloads/code_completion.jsonl, workloads/code_edit.jsonl
                         (format: spec_pair_workloads.py)

Weights depend on the seed and, through float rounding, on the machine and the
thread count; training is bounded by steps, not time. `--quick` trains tiny
models on a small slice of the corpus in seconds, for tests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from spec_pair_corpus import (  # noqa: E402
    encode_files,
    eos_id,
    read_split,
    token_stream,
    train_tokenizer,
)
from spec_pair_models import (  # noqa: E402
    EagleHead,
    Qwen3,
    Shape,
    count_parameters,
    init_weights,
    save_eagle,
    save_qwen3,
)
from spec_pair_training import (  # noqa: E402
    TrainRun,
    eagle_accuracy,
    heldout_windows,
    perplexity,
    train_eagle,
    train_lm,
)
from spec_pair_workloads import (  # noqa: E402
    WORKLOADS_VERSION,
    code_completion,
    code_edit,
    read_jsonl,
    write_jsonl,
    write_trace,
)

from servelab.lab.provenance import cpu_model  # noqa: E402

SCRIPT_VERSION = 1
CACHE_ROOT = Path("~/.cache/servelab/spec_pair")
WORKLOADS = ("code_completion", "code_edit")


@dataclass(frozen=True)
class Settings:
    vocab_size: int
    heldout_percent: int
    max_train_bytes: int | None  # None: every training file
    max_heldout_bytes: int | None
    target: Shape
    draft: Shape
    target_run: TrainRun
    draft_run: TrainRun
    eagle_run: TrainRun
    eval_tokens: int  # held-out tokens the figures are measured on
    requests: int  # per workload
    threads: int  # torch threads while training (float sums depend on it)


def _shape(vocab: int, hidden: int, inner: int, layers: int, heads: int, kv: int, d: int) -> Shape:
    return Shape(vocab, hidden, inner, layers, heads, kv, d, max_position_embeddings=1024)


FULL = Settings(
    vocab_size=4096,
    heldout_percent=5,
    max_train_bytes=None,
    max_heldout_bytes=None,
    target=_shape(4096, 256, 768, 4, 4, 2, 64),
    draft=_shape(4096, 128, 384, 2, 2, 1, 64),
    target_run=TrainRun(steps=360, batch_size=8, seq_len=512, lr=3e-3, warmup=20),
    draft_run=TrainRun(steps=360, batch_size=8, seq_len=512, lr=3e-3, warmup=20),
    eagle_run=TrainRun(steps=240, batch_size=8, seq_len=512, lr=2e-3, warmup=20),
    eval_tokens=65536,
    requests=64,
    threads=2,
)
QUICK = Settings(
    vocab_size=512,
    heldout_percent=5,
    max_train_bytes=300_000,
    max_heldout_bytes=150_000,
    target=_shape(512, 64, 128, 2, 4, 2, 16),
    draft=_shape(512, 32, 64, 1, 2, 1, 16),
    target_run=TrainRun(steps=30, batch_size=4, seq_len=128, lr=3e-3, warmup=5),
    draft_run=TrainRun(steps=20, batch_size=4, seq_len=128, lr=3e-3, warmup=5),
    eagle_run=TrainRun(steps=20, batch_size=4, seq_len=128, lr=2e-3, warmup=5),
    eval_tokens=2048,
    requests=8,
    threads=1,
)


def run_key(settings: Settings, seed: int) -> dict:
    """Everything the weights are a function of, besides the machine."""
    import tokenizers

    return {
        "script_version": SCRIPT_VERSION,
        "seed": seed,
        "settings": dataclasses.asdict(settings),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tokenizers": tokenizers.__version__,
    }


def digest_of(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def default_folder(settings: Settings, seed: int) -> Path:
    return CACHE_ROOT.expanduser() / digest_of(run_key(settings, seed))


def sub_seed(seed: int, name: str) -> int:
    """An independent seed per use (`init/target`, `data/draft`, ...)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:7], "big")


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every weight and tokenizer file of a run folder, by relative path."""
    names = (
        "target/model.safetensors",
        "draft/model.safetensors",
        "eagle/model.safetensors",
        "target/tokenizer.json",
    )
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names}


def read_manifest(folder: Path) -> dict | None:
    path = folder / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _log(message: str) -> None:
    print(f"[spec_pair {time.strftime('%H:%M:%S')}] {message}", flush=True)


def train(settings: Settings, seed: int, folder: Path) -> dict:
    """Builds the run folder (in `<folder>.partial`, renamed when complete) and
    returns its manifest; a complete folder is reused as it is."""
    manifest = read_manifest(folder)
    if manifest is not None:
        _log(f"reusing {folder}")
        if manifest.get("workloads", {}).get("version") != WORKLOADS_VERSION:
            manifest = refresh_workloads(settings, seed, folder, manifest)
        return manifest
    with torch_threads(settings.threads):
        return _build(settings, seed, folder)


def write_workloads(folder: Path, heldout_files: list, tokenizer, settings: Settings, seed: int):
    """Both workloads into `folder/workloads`; returns their manifest entry
    (`WORKLOADS_VERSION` and each file's sha256)."""
    entry: dict = {"version": WORKLOADS_VERSION}
    for name, make in (("code_completion", code_completion), ("code_edit", code_edit)):
        path = folder / "workloads" / f"{name}.jsonl"
        requests = make(heldout_files, tokenizer, settings.requests, seed)
        write_jsonl(path, requests)
        entry[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        trace = folder / "workloads" / f"{name}.trace.jsonl"  # for `workload=trace` presets
        write_trace(trace, requests)
        entry[f"{name}.trace"] = hashlib.sha256(trace.read_bytes()).hexdigest()
    return entry


def link_latest(folder: Path) -> None:
    """`<cache>/latest` -> `folder` (conf/experiment/speculative_decoding.yaml reads it)."""
    link = folder.parent / "latest"
    partial = folder.parent / "latest.partial"
    partial.unlink(missing_ok=True)
    partial.symlink_to(folder.name)
    os.replace(partial, link)
    _log(f"{link} -> {folder.name}")


def refresh_workloads(settings: Settings, seed: int, folder: Path, manifest: dict) -> dict:
    """Rewrites the workloads of a complete folder whose workloads an older
    version of their code wrote: they need the tokenizer, not a retraining."""
    from tokenizers import Tokenizer

    _log(f"writing workloads version {WORKLOADS_VERSION}")
    _, heldout_files = read_split(
        settings.heldout_percent, settings.max_train_bytes, settings.max_heldout_bytes
    )
    tokenizer = Tokenizer.from_file(str(folder / "target" / "tokenizer.json"))
    manifest = {
        **manifest,
        "workloads": write_workloads(folder, heldout_files, tokenizer, settings, seed),
    }
    partial = folder / "manifest.json.partial"
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(partial, folder / "manifest.json")
    return manifest


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` inside, restored after. Pinned
    because float sums depend on it, and because small ops on 2 threads of a
    busy 2-core machine wait on each other far longer than they compute."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _build(settings: Settings, seed: int, folder: Path) -> dict:
    torch.manual_seed(sub_seed(seed, "torch"))
    work = folder.with_name(folder.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    times: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        times[name] = round(now - clock, 1)
        clock = now
        _log(f"{name} done in {times[name]:.1f} s")

    train_files, heldout_files = read_split(
        settings.heldout_percent, settings.max_train_bytes, settings.max_heldout_bytes
    )
    tokenizer = train_tokenizer(train_files, settings.vocab_size)
    eos = eos_id(tokenizer)
    stream = token_stream(encode_files(tokenizer, train_files), eos)
    heldout = token_stream(encode_files(tokenizer, heldout_files), eos)
    _log(
        f"corpus: {len(train_files)} training files ({len(stream)} tokens), "
        f"{len(heldout_files)} held out ({len(heldout)} tokens)"
    )
    lap("tokenizer")

    models: dict[str, Qwen3] = {}
    for name, shape, run in (
        ("target", settings.target, settings.target_run),
        ("draft", settings.draft, settings.draft_run),
    ):
        model = Qwen3(shape)
        init_weights(model, torch.Generator().manual_seed(sub_seed(seed, f"init/{name}")))
        train_lm(model, stream, run, sub_seed(seed, f"data/{name}"), _log)
        save_qwen3(model, work / name, tokenizer.to_str(), "<|endoftext|>", eos)
        models[name] = model
        lap(name)

    head = EagleHead(dataclasses.replace(settings.target, num_layers=1))
    init_weights(head, torch.Generator().manual_seed(sub_seed(seed, "init/eagle")))
    train_eagle(
        head, models["target"], stream, settings.eagle_run, sub_seed(seed, "data/eagle"), _log
    )
    save_eagle(head, work / "eagle", "../target")
    lap("eagle")

    workloads = write_workloads(work, heldout_files, tokenizer, settings, seed)
    windows = heldout_windows(heldout, settings.target_run.seq_len, settings.eval_tokens)
    figures = {
        "target_perplexity": perplexity(models["target"], windows),
        "draft_perplexity": perplexity(models["draft"], windows),
        **eagle_accuracy(head, models["target"], windows),
    }
    lap("held-out figures")
    manifest = {
        "digest": digest_of(run_key(settings, seed)),
        "key": run_key(settings, seed),
        "cpu": cpu_model(),
        "parameters": {
            "target": count_parameters(models["target"]),
            "draft": count_parameters(models["draft"]),
            "eagle": count_parameters(head),
        },
        "corpus": {
            "train_files": len(train_files),
            "train_tokens": len(stream),
            "heldout_files": len(heldout_files),
            "heldout_tokens": len(heldout),
            "heldout_eval_tokens": sum(len(w) for w in windows),
        },
        "heldout": figures,
        "seconds": {**times, "total": round(sum(times.values()), 1)},
        "files": file_digests(work),
        "workloads": workloads,
    }
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    os.replace(work, folder)
    return manifest




def verify(folder: Path) -> dict:
    """servelab loads and serves target and draft as trained (spec_pair_checks)."""
    from spec_pair_checks import verify_model

    prompts = [
        r["prompt_token_ids"] for r in read_jsonl(folder / "workloads/code_completion.jsonl")[:2]
    ]
    return {name: verify_model(folder / name, prompts) for name in ("target", "draft")}


def evaluate(folder: Path) -> dict:
    """First-token agreement with the target on both workloads (spec_pair_checks)."""
    from spec_pair_checks import agreement, generate_continuations

    results = {}
    for name in WORKLOADS:
        requests = read_jsonl(folder / "workloads" / f"{name}.jsonl")
        results[name] = agreement(
            folder, requests, generate_continuations(folder / "target", requests)
        )
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("train", "verify", "evaluate"))
    parser.add_argument("--quick", action="store_true", help="tiny models in seconds (tests)")
    parser.add_argument("--out", type=Path, help="the run folder (default: the cache)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    folder = args.out or default_folder(settings, args.seed)
    start = time.perf_counter()
    manifest = train(settings, args.seed, folder)
    if args.out is None and settings is FULL:  # the presets find the pair through this link
        link_latest(folder)
    print(json.dumps({k: manifest[k] for k in ("parameters", "heldout", "seconds")}, indent=2))
    with torch_threads(settings.threads):
        if args.command == "verify":
            print(json.dumps(verify(folder), indent=2))
        elif args.command == "evaluate":
            print(json.dumps(evaluate(folder), indent=2))
    _log(f"{args.command} finished in {time.perf_counter() - start:.1f} s; folder {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
