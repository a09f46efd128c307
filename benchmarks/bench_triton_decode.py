"""Decode micro-benchmark: the `triton_paged` backend against a plain torch
path (gather the paged K/V into a dense tensor, then SDPA), one layer, one
decode step: store the new token's K/V, attend over the whole context.

    python benchmarks/bench_triton_decode.py           # CUDA: batch 64/256 x context 1k-4k, bf16
    python benchmarks/bench_triton_decode.py --tiny    # CPU smoke test (Triton interpreter)

Prints a Markdown table and writes it to --out (default `$OUT/bench_triton_decode.md`
when `OUT` is set). Every sequence of a row has the same context, so the
torch path needs no mask (its easiest case); block ids are shuffled.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelab.plugins.attention.triton_paged import TritonPagedBackend
from servelab.step.metadata import AttentionMetadata

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class DecodeBatch:
    q: torch.Tensor  # [batch, num_heads, head_dim]
    k: torch.Tensor  # [batch, num_kv_heads, head_dim], this step's token
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    context: int


def make_decode_batch(batch, context, args, device, dtype, gen) -> DecodeBatch:
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq + 1
    physical = torch.randperm(num_blocks).tolist()
    tables = [physical[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]

    def rand(*shape):  # drawn on the device: the largest caches hold ~1G numbers
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    cache_shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    meta = AttentionMetadata.from_lists(
        [1] * batch, [context] * batch, tables, args.block_size, device=device
    )
    return DecodeBatch(
        q=rand(batch, args.num_heads, args.head_dim),
        k=rand(batch, args.num_kv_heads, args.head_dim),
        v=rand(batch, args.num_kv_heads, args.head_dim),
        k_cache=rand(*cache_shape),
        v_cache=rand(*cache_shape),
        meta=meta,
        context=context,
    )


def torch_gather_sdpa(b: DecodeBatch, scale: float) -> torch.Tensor:
    """The baseline: index-put the new K/V, gather every sequence's blocks into
    a dense [batch, kv_heads, context, head_dim] tensor, one SDPA call."""
    num_kv_heads, head_dim = b.k_cache.shape[2:]
    b.k_cache.view(-1, num_kv_heads, head_dim)[b.meta.slot_mapping] = b.k
    b.v_cache.view(-1, num_kv_heads, head_dim)[b.meta.slot_mapping] = b.v
    keys = b.k_cache[b.meta.block_tables].flatten(1, 2)[:, : b.context].transpose(1, 2)
    values = b.v_cache[b.meta.block_tables].flatten(1, 2)[:, : b.context].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        b.q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


def time_ms(fn: Callable[[], object], warmup: int, iters: int, device: torch.device) -> float:
    """Mean milliseconds per call (CUDA events on a GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) * 1000 / iters


def run(args) -> str:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    scale = args.head_dim**-0.5
    backend = TritonPagedBackend(args.num_heads, args.num_kv_heads, args.head_dim, scale)
    backend.check(None, device, dtype)
    torch.manual_seed(0)
    gen = torch.Generator(device=device).manual_seed(0)
    lines = [
        f"decode, {args.num_heads} query / {args.num_kv_heads} KV heads, head_dim "
        f"{args.head_dim}, block_size {args.block_size}, {args.dtype}, {device}",
        "",
        "| batch | context | triton ms | torch ms | speed-up | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in args.batch:
        for context in args.context:
            b = make_decode_batch(batch, context, args, device, dtype, gen)
            triton_ms, torch_ms, diff = compare(backend, b, scale, args, device)
            lines.append(
                f"| {batch} | {context} | {triton_ms:.3f} | {torch_ms:.3f} | "
                f"{torch_ms / triton_ms:.2f}x | {diff:.1e} |"
            )
            print(lines[-1], flush=True)
            del b  # free the caches before the next, larger row
    return "\n".join(lines) + "\n"


def compare(backend, b: DecodeBatch, scale, args, device) -> tuple[float, float, float]:
    """(triton ms, torch ms, max abs difference of their outputs) for one batch."""
    plan = backend.plan(b.meta)
    triton_fn = lambda: backend.forward(b.q, b.k, b.v, (b.k_cache, b.v_cache), plan)
    torch_fn = lambda: torch_gather_sdpa(b, scale)
    diff = (triton_fn().float() - torch_fn().float()).abs().max().item()
    triton_ms = time_ms(triton_fn, args.warmup, args.iters, device)
    torch_ms = time_ms(torch_fn, args.warmup, args.iters, device)
    return triton_ms, torch_ms, diff


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized smoke test")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--num-heads", type=int, default=16)  # Qwen3-0.6B
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--out", default=None, help="Markdown output (default $OUT/bench_triton_decode.md)"
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.batch, args.context = [2, 4], [16, 37]
        args.num_heads, args.num_kv_heads, args.head_dim, args.block_size = 4, 2, 16, 4
        args.dtype, args.device, args.warmup, args.iters = "float32", "cpu", 1, 2
    if args.out is None and os.environ.get("OUT"):
        args.out = os.path.join(os.environ["OUT"], "bench_triton_decode.md")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    table = run(args)
    print()
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
