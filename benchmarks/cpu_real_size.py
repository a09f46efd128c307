"""servelab on this CPU at a real model's size: Qwen3-0.6B's shape with random
weights, against the machine's measured limits, optionally beside vLLM's CPU backend
and llama.cpp.

`--shape` picks a checkpoint shape and the workload that goes with it (SHAPES):
`qwen3-0.6b` (default; 28 layers, hidden 1,024, 16 query / 8 KV heads, head_dim
128, vocabulary 151,936, tied embedding; 32 requests, prompts uniform in [64, 512]
tokens, outputs in [32, 128]) or `tiny`, servelab's embedded tiny Qwen3 with
head_dim 32 instead of 16, the smallest vLLM's CPU attention takes (64 requests,
prompts in [32, 256], outputs in [16, 256]). The seed-0 checkpoint is written in
Hugging Face's format to a temporary folder, so both engines load the same weights.
Requests are greedy, `ignore_eos`, all at once; servelab runs `continuous` +
`paged` + `flash_varlen`.

Measured in this process first: the float32 matmul peak (the best of MKL, oneDNN
and servelab's packed kernel), the bfloat16 one (oneDNN where the CPU runs it
natively, else torch's), and the memory read bandwidth (the best of a sum and a
one-row matmul streaming a weight). Each engine run is a fresh process; runs alternate (servelab, vLLM,
vLLM, servelab per repeat) so a slow spell of a shared machine falls on both.
Reported per run: output tok/s; for servelab also the prefill steps' matmul
TFLOP/s and the decode steps' read GB/s (weights counted from the shape, plus the
K/V the cache holds at each decode step), as fractions of the peaks, and the
greedy tokens' agreement with vLLM's. With two runs or more a side, servelab /
vLLM comes with a 95% interval (`servelab.lab.stats.ratio_estimate`, paired by
round).

Batch 1 is a row of its own: one request (a `--batch1-prompt`-token prompt,
`--batch1-tokens` output tokens, greedy, `ignore_eos`) served alone, reported as
decode tok/s: the tokens after the first over the decode steps' seconds, prefill
excluded. servelab runs it in a process of its own once per round and dtype.

With `--llama-cpp PYTHON` (a venv with llama-cpp-python), llama.cpp joins: the
checkpoint is converted once per dtype with llama.cpp's own converter (F32 or
BF16; the GGUF is cached beside the checkpoint, named by a hash of its files)
and `llama_cpp_peer.py` serves batch 1 and then the workload through llama.cpp's
batched API, with `--threads` threads; both are compared with servelab's tokens.

    python benchmarks/cpu_real_size.py --dtypes float32 bfloat16
    python benchmarks/cpu_real_size.py --vllm-python /work/venvs/vllm/bin/python --requests 8
    python benchmarks/cpu_real_size.py --shape tiny --dtypes float32 --vllm-python ...
    python benchmarks/cpu_real_size.py --llama-cpp /work/venvs/llama/bin/python --requests 8
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve()
LLAMA_PEER = HERE.parent / "llama_cpp_peer.py"
GGUF_TYPE = {"float32": "f32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Shape:
    """A checkpoint shape (one of servelab's named shapes, head_dim optionally
    changed) and the workload served on it; token-count ranges are inclusive."""

    model: str
    requests: int
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    head_dim: int | None = None
    max_model_len: int = 1024

    def config(self):
        """servelab's ModelConfig of this shape."""
        from servelab.model.config import named_config

        c = named_config(self.model)
        return c if self.head_dim is None else replace(c, head_dim=self.head_dim)


SHAPES = {
    "qwen3-0.6b": Shape("qwen3-0.6b", requests=32, prompt_tokens=(64, 512), output_tokens=(32, 128)),
    # vLLM's CPU attention takes head_dim 32 and up, not the embedded model's 16
    "tiny": Shape("tiny", requests=64, prompt_tokens=(32, 256), output_tokens=(16, 256), head_dim=32),
}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-0.6b",
                   help="checkpoint shape and its workload (default qwen3-0.6b)")  # fmt: skip
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--requests", type=int, help="default: the shape's workload's count")
    p.add_argument("--repeats", type=int, default=1, help="alternating rounds (default 1)")
    p.add_argument(
        "--pattern",
        choices=("ABBA", "AB"),
        default="ABBA",
        help="one round: servelab, vLLM, vLLM, servelab (ABBA) or once each (AB)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-python", type=Path, help="a python with vllm installed")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument("--llama-cpp", type=Path, metavar="PYTHON",
                   help="a python with llama-cpp-python: llama.cpp on the same checkpoint")  # fmt: skip
    p.add_argument("--gguf-converter", type=Path,
                   help="llama.cpp's convert_hf_to_gguf.py (default: "
                        "llama-src/vendor/llama.cpp/ beside --llama-cpp's venv)")  # fmt: skip
    p.add_argument("--batch1-prompt", type=int, default=128, help="batch 1's prompt tokens")
    p.add_argument("--batch1-tokens", type=int, default=128, help="batch 1's output tokens")
    p.add_argument("--cpu-kernels", default="auto", help="servelab's engine.cpu_kernels")
    p.add_argument("--attention-impl", default="auto", help="flash_varlen's impl for servelab")
    p.add_argument("--kv-cache", default="3GiB", help="servelab's engine.kv_cache_memory")
    p.add_argument("--checkpoint", type=Path, help="reuse this folder instead of a new one")
    p.add_argument("--json", type=Path, help="write every run here")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--worker", choices=("servelab", "vllm"), help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--workload", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the machine's limits, measured here


def _best(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _float32_peak(n: int) -> tuple[float, str]:
    """The float32 matmul peak: the best of the paths servelab's CPU matmul can
    take (MKL, oneDNN prepacked, servelab's packed kernel where it is built), on
    an n x n x n product; and which path gave it."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    times = {"MKL": _best(lambda: a @ b)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b, None)
        times["oneDNN prepacked"] = _best(
            lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
        )
    except RuntimeError:
        pass
    from servelab.kernels import cpu_linear

    if cpu_linear.kernel() is not None:
        linear = cpu_linear.PackedLinear(b, None)
        times["servelab packed"] = _best(lambda: linear(a))
    path = min(times, key=times.get)
    return 2 * n**3 / times[path], path


def machine_peaks(threads: int) -> dict:
    """Matmul peaks (FLOP/s, float32 and bfloat16; each the best path here) and
    read bandwidth (bytes/s, the best of ten sums over 256 MiB)."""
    import torch

    torch.set_num_threads(threads)
    n = 2048
    peaks: dict = {}
    peaks["float32"], peaks["float32_path"] = _float32_peak(n)
    w = torch.randn(4096, n).bfloat16()
    x = torch.randn(512, n).bfloat16()
    try:  # oneDNN's prepacked bf16 linear: the matrix units where the CPU has them
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        t = _best(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        peaks["bfloat16_path"] = "oneDNN prepacked"
    except RuntimeError:
        t = _best(lambda: torch.nn.functional.linear(x, w), 1)
        peaks["bfloat16_path"] = "torch F.linear (no native bf16 matmul)"
    peaks["bfloat16"] = 2 * 512 * n * 4096 / t
    peaks["read_bytes_s"] = _read_bandwidth()
    return peaks


def _read_bandwidth() -> float:
    """Bytes/s read from memory: the best of a sum over 256 MiB and (where servelab's
    packed kernel is built) a one-row matmul streaming a 512 MiB weight, what a
    decode step does; each the best of ten. On a shared machine one of them can
    meet a busy spell, hence two. Both read from 2 MiB pages where the system gives
    them, as servelab's weights are (`servelab.kernels.huge_pages`)."""
    import torch

    from servelab.kernels import huge_pages

    big = huge_pages.empty((256 * 2**20 // 4,), torch.float32).fill_(1.0)
    best = big.numel() * 4 / _best(lambda: big.sum(), repeats=10)
    from servelab.kernels import cpu_linear

    if cpu_linear.kernel() is not None:
        linear = cpu_linear.PackedLinear(torch.randn(65536, 2048), None)
        x = torch.randn(1, 2048)
        best = max(best, 65536 * 2048 * 4 / _best(lambda: linear(x), repeats=10))
    return best


# -- the checkpoint and the workload


def hf_config(shape: Shape):
    """transformers' Qwen3 config of the shape."""
    from transformers import Qwen3Config

    c = shape.config()
    return Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position_embeddings, torch_dtype="float32",
    )  # fmt: skip


def write_checkpoint(folder: Path, shape: Shape) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(hf_config(shape)).save_pretrained(folder, safe_serialization=True)


def write_workload(path: Path, shape: Shape, num_requests: int | None = None) -> list[dict]:
    """The shape's workload (`num_requests` of it, default the shape's count): token
    ids uniform over the vocabulary, lengths uniform over the shape's ranges."""
    import numpy as np

    rng = np.random.default_rng(0)
    (p_lo, p_hi), (o_lo, o_hi) = shape.prompt_tokens, shape.output_tokens
    vocab = shape.config().vocab_size
    requests = [
        {
            "prompt": rng.integers(0, vocab, int(rng.integers(p_lo, p_hi + 1))).tolist(),
            "max_tokens": int(rng.integers(o_lo, o_hi + 1)),
        }
        for _ in range(shape.requests if num_requests is None else num_requests)
    ]
    path.write_text(json.dumps(requests))
    return requests


def write_batch1(path: Path, shape: Shape, prompt_tokens: int, output_tokens: int) -> list[dict]:
    """The batch-1 workload: one request, its prompt's ids uniform over the vocabulary."""
    import numpy as np

    prompt = np.random.default_rng(1).integers(0, shape.config().vocab_size, prompt_tokens)
    requests = [{"prompt": prompt.tolist(), "max_tokens": output_tokens}]
    path.write_text(json.dumps(requests))
    return requests


def gguf_path(checkpoint: Path, dtype: str) -> Path:
    """Where the checkpoint's GGUF of `dtype` is cached: beside the checkpoint's
    folder, named by a hash of its config and weights, so another checkpoint in
    the same place is converted anew."""
    digest = hashlib.sha256()
    for f in sorted(checkpoint.glob("*.json")) + sorted(checkpoint.glob("*.safetensors")):
        digest.update(f.name.encode())
        with f.open("rb") as data:
            digest.update(hashlib.file_digest(data, "sha256").digest())
    return (
        checkpoint.parent / f"{checkpoint.name}-{digest.hexdigest()[:16]}-{GGUF_TYPE[dtype]}.gguf"
    )


def gguf_converter(args) -> Path:
    """llama.cpp's HF-to-GGUF converter: --gguf-converter, else the unpacked
    llama-cpp-python sdist at llama-src/ beside the venv of --llama-cpp."""
    if args.gguf_converter is not None:
        return args.gguf_converter
    # PYTHON is VENV/bin/python; don't resolve it: a venv's python links elsewhere
    venv = Path(os.path.abspath(args.llama_cpp)).parent.parent
    return venv.parent / "llama-src" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"


def ensure_gguf(args, dtype: str) -> Path:
    """The checkpoint as GGUF, converted by llama.cpp's converter unless cached."""
    out = gguf_path(args.checkpoint, dtype)
    if not out.exists():
        cmd = [str(args.llama_cpp), str(LLAMA_PEER), "convert", str(args.checkpoint), str(out),
               "--outtype", GGUF_TYPE[dtype], "--converter", str(gguf_converter(args))]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"GGUF conversion failed:\n{done.stderr[-3000:]}")
    return out


def matmul_params(shape: Shape) -> int:
    """Weights a token's projections multiply (no embedding, no LM head)."""
    c = shape.config()
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    qkv = h * d * (c.num_heads + 2 * c.num_kv_heads)
    o = c.num_heads * d * h
    return c.num_layers * (qkv + o + 3 * h * i)


# -- the workers (a fresh process each)


def servelab_worker(args) -> dict:
    import torch

    from servelab import SamplingParams
    from servelab.engine.build import build_engine

    shape = SHAPES[args.shape]
    requests = json.loads(args.workload.read_text())
    engine = build_engine({
        "model": {"name": f"{args.shape}-random", "path": str(args.checkpoint)},
        "scheduler": {"name": "continuous"}, "allocator": {"name": "paged"},
        "attention": {"name": "flash_varlen", "impl": args.attention_impl},
        "engine": {"dtype": args.dtype, "num_threads": args.threads, "device": "cpu",
                   "max_model_len": shape.max_model_len, "cpu_kernels": args.cpu_kernels,
                   "kv_cache_memory": args.kv_cache, "swap_space": "64MiB"},
    })  # fmt: skip
    torch.set_num_threads(args.threads)
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():  # warm-up: packing, first-call costs
        engine.step()
    start, cpu_start = time.perf_counter(), time.process_time()
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
        engine.add_request(r["prompt"], params, request_id=str(i))
    first = len(engine.metrics.steps)
    outputs, decode_cpu_s = {}, 0.0
    while engine.has_unfinished():
        n, cpu = len(engine.metrics.steps), time.process_time()
        finished = engine.step()  # the requests that finished in the step
        if all(s.prefill_tokens == 0 for s in engine.metrics.steps[n:]):
            decode_cpu_s += time.process_time() - cpu
        for o in finished:
            outputs[o.request_id] = list(o.token_ids)
    # the engine's own step records say which steps ran a prompt (or a chunk of one)
    steps = engine.metrics.steps[first:]
    prefill_s = sum(s.wall_time for s in steps if s.prefill_tokens > 0)
    decode = [s for s in steps if s.prefill_tokens == 0]
    decode_s, decode_steps = sum(s.wall_time for s in decode), len(decode)
    decode_rows = sum(s.decode_tokens for s in decode)
    wall, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    weight_bytes = torch.finfo(getattr(torch, args.dtype)).bits // 8  # the KV cache's too
    c = shape.config()
    lm_head = c.vocab_size * c.hidden_size
    kv_token_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * weight_bytes
    prompt_tokens = sum(len(r["prompt"]) for r in requests)
    return {
        "wall_s": wall,
        "cpu_s": cpu_s,  # the process's CPU seconds, all threads: a busy machine's
        "decode_cpu_s": decode_cpu_s,  # other processes count in the wall time only
        "output_tokens": sum(len(t) for t in outputs.values()),
        "tokens": [outputs[str(i)] for i in range(len(requests))],
        "prefill_s": prefill_s,
        "prefill_flop": 2 * matmul_params(shape) * prompt_tokens,
        "decode_s": decode_s,
        "decode_steps": decode_steps,
        "decode_rows": decode_rows,
        "decode_weight_bytes": decode_steps * (matmul_params(shape) + lm_head) * weight_bytes,
        # each decode step reads its sequences' whole K/V: the tokens the cache holds
        "decode_kv_bytes": sum(s.kv_tokens_used for s in decode) * kv_token_bytes,
    }


def vllm_worker(args) -> dict:
    try:
        import torchvision  # noqa: F401
    except Exception:  # built for another torch: a text model needs none, so vLLM goes without
        for name in [m for m in sys.modules if m.startswith("torchvision")]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # type: ignore[assignment]
    from vllm import LLM, SamplingParams

    requests = json.loads(args.workload.read_text())
    llm = LLM(
        model=str(args.checkpoint), dtype=args.dtype, skip_tokenizer_init=True,
        max_model_len=SHAPES[args.shape].max_model_len, enforce_eager=args.vllm_eager, seed=0,
        max_num_seqs=max(len(requests), 1),
    )  # fmt: skip
    prompts = [{"prompt_token_ids": r["prompt"]} for r in requests]
    params = [
        SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True,
                       detokenize=False)
        for r in requests
    ]  # fmt: skip
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params[:1], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"wall_s": wall, "output_tokens": sum(map(len, tokens)), "tokens": tokens}


def run_worker(args, system: str, dtype: str, python: str, workload: Path) -> dict:
    """One fresh process of `system` serving `workload`; llama.cpp's serves the
    batch-1 workload (`batch1.json` beside it) first, in the same process."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if system == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if system == "llama.cpp":
        cmd = [python, str(LLAMA_PEER), "run", str(ensure_gguf(args, dtype)),
               "--workload", str(workload), "--batch1", str(workload.parent / "batch1.json"),
               "--threads", str(args.threads), "--dtype", dtype]  # fmt: skip
    else:
        cmd = [python, str(HERE), "--worker", system, "--shape", args.shape, "--dtype", dtype,
               "--workload", str(workload),
               "--checkpoint", str(args.checkpoint), "--threads", str(args.threads),
               "--cpu-kernels", args.cpu_kernels, "--kv-cache", args.kv_cache,
               "--attention-impl", args.attention_impl]  # fmt: skip
    if args.vllm_eager and system == "vllm":
        cmd.append("--vllm-eager")
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{system} {dtype} failed:\n{done.stderr[-3000:]}")
    # the whole process (loading, compiling, warm-up) besides the timed part
    return {**json.loads(lines[-1]), "process_s": time.perf_counter() - start}


# -- the report


def describe(system: str, dtype: str, run: dict, peaks: dict) -> str:
    line = f"{system:9s} {dtype:9s} {run['output_tokens'] / run['wall_s']:7.2f} out tok/s"
    line += f"  ({run['wall_s']:.1f} s; process {run['process_s']:.0f} s)"
    if "cpu_s" in run:
        line += f"  {cpu_rate(run):.2f} tok per CPU-s"
    if "batched" in run:  # llama.cpp's
        line += "  batched API" if run["batched"] else "  one request at a time (no batched API)"
        line += f": prefill {run['prefill_s']:.1f} s, decode {run['decode_s']:.1f} s"
        line += f" (mean batch {run['decode_rows'] / max(run['decode_steps'], 1):.1f})"
    if "prefill_flop" in run and run["prefill_s"] > 0:
        flops = run["prefill_flop"] / run["prefill_s"]
        peak = peaks["float32"] if dtype == "float32" else max(peaks["float32"], peaks["bfloat16"])
        line += f"  prefill {flops / 1e12:.3g} TFLOP/s = {flops / peak:.1%} of peak"
    if "decode_weight_bytes" in run and run["decode_s"] > 0:
        weights = run["decode_weight_bytes"] / run["decode_s"]
        rate = weights + run.get("decode_kv_bytes", 0) / run["decode_s"]
        line += f"  decode {rate / 1e9:.3g} GB/s = {rate / peaks['read_bytes_s']:.1%} of read bw"
        line += f" (weights {weights / 1e9:.3g}, K/V {(rate - weights) / 1e9:.3g};"
        line += f" mean batch {run['decode_rows'] / max(run['decode_steps'], 1):.1f})"
    return line


def decode_rate(run: dict) -> float:
    """Decode tok/s: the tokens the decode steps made over their seconds (no prefill)."""
    return run["decode_rows"] / run["decode_s"]


def cpu_rate(run: dict) -> float:
    """Output tokens per CPU-second of the process (less sensitive to a busy machine)."""
    return run["output_tokens"] / run["cpu_s"]


def decode_cpu_rate(run: dict) -> float:
    return run["decode_rows"] / run["decode_cpu_s"]


def describe_batch1(system: str, dtype: str, run: dict) -> str:
    return (
        f"{system:9s} {dtype:9s} batch 1: {decode_rate(run):7.2f} decode tok/s"
        f"  ({run['decode_rows']} tokens in {run['decode_s']:.2f} s; prefill {run['prefill_s']:.2f} s)"
        f"  {decode_cpu_rate(run):.2f} decode tok per CPU-s"
    )


def compare(mine: list[dict], theirs: list[dict], rate=None) -> str:
    """servelab / a peer's output tok/s (or `rate`'s): the ratio of means; with two runs or more a
    side, `ratio_estimate`'s ratio and 95% interval: paired by round (each round's
    runs of a side averaged) over two rounds or more, else over the runs."""
    import math

    from servelab.lab.stats import ratio_estimate

    if rate is None:

        def rate(r: dict) -> float:
            return r["output_tokens"] / r["wall_s"]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    text = f"{mean([rate(r) for r in mine]) / mean([rate(r) for r in theirs]):.2f}x"
    if min(len(mine), len(theirs)) < 2:
        return text
    rounds = sorted({r["round"] for r in mine} & {r["round"] for r in theirs})
    if len(rounds) >= 2:
        a = [mean([rate(r) for r in mine if r["round"] == k]) for k in rounds]
        b = [mean([rate(r) for r in theirs if r["round"] == k]) for k in rounds]
        est, how = ratio_estimate(a, b, paired=True), f"{len(rounds)} rounds, paired"
    else:
        a, b = [rate(r) for r in mine], [rate(r) for r in theirs]
        est, how = ratio_estimate(a, b), f"{len(a)} and {len(b)} runs"
    if not math.isnan(est.low):
        text += f"; estimate {est.mean:.2f}x, 95% interval {est.low:.2f}-{est.high:.2f}x ({how})"
    return text


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """How many requests got identical tokens, and where the others first differ."""
    differ = [
        next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        for x, y in zip(a, b, strict=True)
        if x != y
    ]
    text = f"{len(a) - len(differ)}/{len(a)} identical"
    if differ:
        text += f"; the other {len(differ)} first differ at token {sum(differ) / len(differ):.1f} on average"
    return text


def report(runs: list[dict], batch1_runs: list[dict], dtypes: list[str]) -> None:
    """servelab / each peer, for the workload and for batch-1 decode: the wall-clock
    ratio, the CPU-second one where both sides counted it, and the greedy tokens'
    agreement (the first runs')."""
    comparisons = (
        ("", runs, None, cpu_rate),
        ("batch-1 decode ", batch1_runs, decode_rate, decode_cpu_rate),
    )
    for dtype in dtypes:
        for peer, name in (("vllm", "vLLM"), ("llama.cpp", "llama.cpp")):
            for label, rows, rate, cpu in comparisons:
                mine = [r for r in rows if r["dtype"] == dtype and r["system"] == "servelab"]
                theirs = [r for r in rows if r["dtype"] == dtype and r["system"] == peer]
                if not (mine and theirs):
                    continue
                text = f"{dtype}: {label}servelab / {name} = {compare(mine, theirs, rate)}"
                if all("cpu_s" in r for r in mine + theirs):
                    text += f" (per CPU-second {compare(mine, theirs, cpu)})"
                tokens = agreement(mine[0]["tokens"], theirs[0]["tokens"])
                print(f"{text}; greedy tokens {tokens}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker = servelab_worker if args.worker == "servelab" else vllm_worker
        print(json.dumps(worker(args)))
        return 0
    peaks = machine_peaks(args.threads)
    print(
        f"machine ({args.threads} threads): float32 matmul {peaks['float32'] / 1e9:.1f} GFLOP/s "
        f"({peaks['float32_path']}), "
        f"bfloat16 matmul {peaks['bfloat16'] / 1e9:.1f} GFLOP/s ({peaks['bfloat16_path']}), "
        f"read {peaks['read_bytes_s'] / 1e9:.1f} GB/s; load average {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory(prefix="servelab-real-size-") as tmp:
        if args.checkpoint is None:
            args.checkpoint = Path(tmp) / "checkpoint"
            write_checkpoint(args.checkpoint, SHAPES[args.shape])
        workload = Path(tmp) / "workload.json"
        requests = write_workload(workload, SHAPES[args.shape], args.requests)
        batch1 = workload.parent / "batch1.json"
        write_batch1(batch1, SHAPES[args.shape], args.batch1_prompt, args.batch1_tokens)
        print(f"shape {args.shape}: {len(requests)} requests, "
              f"{sum(len(r['prompt']) for r in requests)} prompt tokens, "
              f"{sum(r['max_tokens'] for r in requests)} output tokens; batch 1: "
              f"{args.batch1_prompt} prompt tokens, {args.batch1_tokens} output tokens")  # fmt: skip
        systems = [("servelab", sys.executable)]
        if args.vllm_python:
            systems.append(("vllm", str(args.vllm_python)))
        if args.llama_cpp:
            systems.append(("llama.cpp", str(args.llama_cpp)))
        order = systems + systems[::-1] if args.pattern == "ABBA" else systems
        runs, batch1_runs = [], []
        for k in range(args.repeats):
            for dtype in args.dtypes:
                run = run_worker(args, "servelab", dtype, sys.executable, batch1)
                batch1_runs.append({"system": "servelab", "dtype": dtype, "round": k, **run})
                print(describe_batch1("servelab", dtype, run), flush=True)
                for system, python in order:
                    run = run_worker(args, system, dtype, python, workload)
                    runs.append({"system": system, "dtype": dtype, "round": k, **run})
                    if "batch1" in run:
                        one = run.pop("batch1")
                        batch1_runs.append({"system": system, "dtype": dtype, "round": k, **one})
                        print(describe_batch1(system, dtype, one), flush=True)
                    print(describe(system, dtype, run, peaks), flush=True)
        report(runs, batch1_runs, args.dtypes)
    if args.json:
        args.json.write_text(
            json.dumps({"peaks": peaks, "runs": runs, "batch1_runs": batch1_runs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
