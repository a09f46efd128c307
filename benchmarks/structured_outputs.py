"""What structured outputs cost a step: at batch sizes 1, 8, 64 and 256, every
request constrained by one JSON schema (nested object, enum, integers, an array),
on the tiny model and on the Qwen3-0.6B shape (random weights, float32).

    python benchmarks/structured_outputs.py [--models tiny qwen3-0.6b]
        [--batches 1 8 64 256] [--repeats 3] [--max-tokens 8] [--out results.json]
    python benchmarks/structured_outputs.py --validity [--pair DIR]

Per (model, batch) one engine with `max_num_seqs = B`; each repeat runs the batch
twice side by side, constrained and plain (the order alternating by repeat), greedy,
B prompts of 16 random ids, `max_tokens` each (`ignore_eos` on the plain run, so
both run every decode step; a constrained request may end early, when its JSON is
complete). Over the decode steps that ran all B requests it reports:

- `mask %`: the steps' `grammar_mask_ms` (filling the bitmask rows and applying
  them, `servelab.model.grammar`) over their wall time;
- `step ratio`: the constrained decode step's mean time over the plain one's,
  paired by repeat (the whole cost, with the logits copy and the sampler's
  per-row path that a constrained row takes);

each a mean over repeats with a 95% t interval (`servelab.lab.stats`).

`--validity` runs the trained pair's target (benchmarks/spec_pair.py) on the
code-completion workload's prompts under one constraint of each kind, greedy and
sampled (temperature 0.8, top-p 0.95, seeded): how many outputs complete within
`max_tokens` and how many of those validate (jsonschema, re.fullmatch, the choice
list, the grammar's regex).

The tiny model's tokenizer has 512 ids; the Qwen3-0.6B shape has no tokenizer, and
its own (151,643 ids) cannot be fetched offline, so it gets a byte-level BPE
trained here on the Python standard library's source with `tokenizers` (about
120,000 ids; cached in ~/.cache/servelab/bench_tokenizers/), its ids padded to the
model's 151,936 (those past the tokenizer are never allowed). A mask's cost grows
with the vocabulary, so this is close to, not exactly, the real model's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sysconfig

import torch

from servelab import LLM, SamplingParams
from servelab.lab.provenance import cpu_model
from servelab.lab.stats import interval_text, mean_estimate, ratio_estimate, rounded
from servelab.model.config import NAMED_SHAPES

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "label": {"type": "string"}},
            "required": ["x", "label"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["id", "kind", "point", "tags"],
}
TOKENIZERS = pathlib.Path.home() / ".cache" / "servelab" / "bench_tokenizers"
SPEC_PAIRS = pathlib.Path.home() / ".cache" / "servelab" / "spec_pair"


def stdlib_tokenizer():
    """A byte-level BPE trained on the standard library's *.py files (cached), with the
    trained pair's trainer (spec_pair_corpus.train_tokenizer) aiming at Qwen3's size."""
    from spec_pair_corpus import SourceFile, train_tokenizer
    from tokenizers import Tokenizer

    path = TOKENIZERS / "stdlib-bpe.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [SourceFile(str(p), p.read_bytes().decode("utf-8", "replace"))
             for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts]  # fmt: skip
    tokenizer = train_tokenizer(files, vocab_size=151_643, min_frequency=1)
    TOKENIZERS.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


def build(model: str, batch: int) -> LLM:
    shape = NAMED_SHAPES[model]
    kv_bytes_per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * 4
    llm = LLM(model=model, dtype="float32", max_num_seqs=batch,
              max_num_batched_tokens=max(2048, 16 * batch), max_model_len=256,
              kv_cache_memory=(batch + 8) * 64 * kv_bytes_per_token)  # fmt: skip
    if llm.engine.tokenizer is None:  # the 0.6B shape: the benchmark's stand-in tokenizer
        tokenizer = stdlib_tokenizer()
        llm.engine.tokenizer = llm.engine.executor.tokenizer = tokenizer
    return llm


def decode_steps(llm: LLM, first: int, batch: int) -> list[dict]:
    rows = [s.row() for s in llm.engine.metrics.steps[first:]]
    return [r for r in rows if r["num_seqs"] == batch and r["decode_tokens"] == batch]


def run_once(llm: LLM, prompts, batch: int, max_tokens: int, constrained: bool) -> dict:
    if constrained:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                structured_outputs={"json": SCHEMA})  # fmt: skip
    else:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = len(llm.engine.metrics.steps)
    llm.generate(prompts, params)
    steps = decode_steps(llm, first, batch)
    wall = sum(s["wall_time"] for s in steps)
    mask = sum(s.get("grammar_mask_ms", 0.0) for s in steps) / 1e3
    return {"steps": len(steps), "step_ms": 1e3 * wall / max(1, len(steps)),
            "mask_pct": 100 * mask / wall if wall else float("nan")}  # fmt: skip


def measure(model: str, batch: int, repeats: int, max_tokens: int) -> dict:
    llm = build(model, batch)
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(4, min(vocab, 500), (16,), generator=gen).tolist()
               for _ in range(batch)]  # fmt: skip
    run_once(llm, prompts, batch, 2, True)  # warm: kernels, the grammar compile
    run_once(llm, prompts, batch, 2, False)
    plain, constrained = [], []
    for r in range(repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        for c in order:
            (constrained if c else plain).append(run_once(llm, prompts, batch, max_tokens, c))
    ratio = ratio_estimate([c["step_ms"] for c in constrained], [p["step_ms"] for p in plain],
                           paired=True)  # fmt: skip
    mask = mean_estimate([c["mask_pct"] for c in constrained])
    return {"model": model, "batch": batch, "repeats": repeats,
            "plain_step_ms": mean_estimate([p["step_ms"] for p in plain]).mean,
            "constrained_step_ms": mean_estimate([c["step_ms"] for c in constrained]).mean,
            "decode_steps_per_run": [c["steps"] for c in constrained],
            "mask_pct": mask.mean, "mask_pct_ci": interval_text(mask),
            "step_ratio": ratio.mean, "step_ratio_ci": interval_text(ratio),
            "mask_pct_text": rounded(mask), "step_ratio_text": rounded(ratio)}  # fmt: skip


# for the validity run: strings bounded by a pattern, as a tool's arguments often are
# (an undertrained model may not close an unbounded string before max_tokens)
BOUNDED = {**SCHEMA, "properties": {
    **SCHEMA["properties"],
    "point": {"type": "object", "required": ["x", "label"],
              "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                             "label": {"type": "string", "pattern": "^[a-z_]{1,12}$"}}},
    "tags": {"type": "array", "maxItems": 3,
             "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
}}  # fmt: skip
VALIDITY = {
    "json": ({"json": BOUNDED}, lambda t: jsonschema_valid(t)),
    "regex": ({"regex": r"[A-Z][a-z]{2,8}_[0-9]{1,3}"},
              lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}_[0-9]{1,3}", t) is not None),
    "choice": ({"choice": ["return None", "raise ValueError", "pass"]},
               lambda t: t in ("return None", "raise ValueError", "pass")),
    "grammar": ({"grammar": 'root ::= name "(" (name ("," " " name){0,2})? ")"\n'
                            'name ::= [a-z_] [a-z_0-9]{0,11}'},
                lambda t: re.fullmatch(r"[a-z_]\w{0,11}\((\w+(, \w+){0,2})?\)", t) is not None),
}  # fmt: skip


def jsonschema_valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), BOUNDED)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def validity(pair: pathlib.Path, requests: int, max_tokens: int) -> list[dict]:
    lines = (pair / "workloads" / "code_completion.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][:requests]
    llm = LLM(model=str(pair / "target"), dtype="float32", max_model_len=1024)
    rows = []
    for kind, (constraint, valid) in VALIDITY.items():
        for temperature in (0.0, 0.8):
            params = SamplingParams(temperature=temperature, top_p=0.95, seed=0,
                                    max_tokens=max_tokens, structured_outputs=constraint)  # fmt: skip
            outs = llm.generate(prompts, params)
            done = [o for o in outs if o.finish_reason == "stop"]
            rows.append({"kind": kind, "temperature": temperature, "requests": len(outs),
                         "completed": len(done), "valid": sum(valid(o.text) for o in done),
                         "example": done[0].text if done else outs[0].text})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen3-0.6b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--validity", action="store_true")
    parser.add_argument("--pair", type=pathlib.Path)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    if args.validity:
        pair = args.pair or max(SPEC_PAIRS.glob("*/manifest.json"),
                                key=lambda p: p.stat().st_mtime).parent  # fmt: skip
        print(f"# {pair.name}: the trained target, code_completion prompts")
        print("| kind | temperature | requests | completed | valid | an output |")
        print("|---|---|---|---|---|---|")
        for r in validity(pair, args.requests, 160):
            print(f"| {r['kind']} | {r['temperature']} | {r['requests']} | {r['completed']} "
                  f"| {r['valid']} | `{r['example'][:60]!r}` |", flush=True)  # fmt: skip
        return
    name = cpu_model()
    print(f"# {name}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print("| model | batch | plain step (ms) | constrained step (ms) | mask % of the step "
          "(95% CI) | step ratio (95% CI) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    results = []
    for model in args.models:
        for batch in args.batches:
            r = measure(model, batch, args.repeats, args.max_tokens)
            results.append(r)
            print(f"| {model} | {batch} | {r['plain_step_ms']:.1f} | {r['constrained_step_ms']:.1f} "
                  f"| {r['mask_pct_text']} | {r['step_ratio_text']} |", flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"cpu": name, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
