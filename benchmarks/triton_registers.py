"""Compiles every Triton kernel for Hopper (sm_90) on any machine and reports
registers, spills and resident blocks per SM, read from the CUDA assembler.

Triton ships `ptxas`, so `triton.compile` with a `GPUTarget("cuda", 90, 32)`
needs no GPU; the compiled kernel's register figures come from the driver on
a GPU only, so this script runs `ptxas -v` on the kernel's PTX itself. Every
head size the engine's named models use (16, 64, 128) and the largest the
attention backend takes (256), in every dtype it takes, each kernel at the
launch parameters the engine picks (`attention_tiles`, `compile_specs`).

    python benchmarks/triton_registers.py                  # every shape and dtype
    python benchmarks/triton_registers.py --json out.json
    PYTHONPATH=/work/venvs/triton36/lib/python3.11/site-packages \
        python benchmarks/triton_registers.py              # another Triton's compiler

Must run with TRITON_INTERPRET unset (it sets 0 itself): the kernels have to
be defined as compiled functions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from servelab.kernels import triton_fused as tf  # noqa: E402
from servelab.plugins.attention import triton_kernels as tk  # noqa: E402
from servelab.plugins.attention.triton_tiles import attention_tiles  # noqa: E402

SM90_REGISTERS = 65536  # per SM
SM90_MAX_BLOCKS = 32
SM90_SHARED = 227 * 1024  # per SM, usable by blocks
TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
TL_DTYPE = {
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}
DTYPES = tuple(TYPE)
# (hidden, heads, kv_heads, head_dim, inner): Qwen3-0.6B, the tiny test model, the
# `bench` model, and head_dim 256 (the largest the attention backend takes)
SHAPES = (
    (1024, 16, 8, 128, 3072),
    (64, 4, 2, 16, 128),
    (256, 4, 2, 64, 512),
    (2048, 8, 4, 256, 6144),
)


@dataclass
class Compiled:
    kernel: str
    shape: str
    dtype: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int
    blocks_per_sm: int


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, spill store + load bytes) of the one kernel in `ptx`."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(90).path, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return registers, spills


def blocks_per_sm(registers: int, num_warps: int, shared: int) -> int:
    threads = 32 * num_warps
    by_regs = SM90_REGISTERS // (max(registers, 1) * threads)
    by_shared = SM90_SHARED // shared if shared else SM90_MAX_BLOCKS
    return min(by_regs, by_shared, SM90_MAX_BLOCKS, 2048 // threads)


def compile_sm90(fn, pointers, floats, constexprs, num_warps, num_stages, label) -> Compiled:
    """Compiles `fn` for sm_90: `pointers` maps pointer args to element types,
    `floats` lists fp32 scalars, every other non-constexpr arg is an i32."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    src = ASTSource(fn, signature, constexprs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    registers, spills = ptxas_usage(kernel.asm["ptx"])
    shared = kernel.metadata.shared
    kernel_name, shape, dtype = label
    return Compiled(
        kernel_name,
        shape,
        dtype,
        registers,
        spills,
        shared,
        num_warps,
        blocks_per_sm(registers, num_warps, shared),
    )


def attention(heads, kv_heads, head_dim, dtype, max_query_len, name) -> Compiled:
    group = heads // kv_heads
    tiles = attention_tiles(max_query_len, group, head_dim, dtype, interpreted=False)
    t = TYPE[dtype]
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    # as `paged_attention` launches it compiled: 16-bit operands stay 16-bit for the tensor cores
    dot = TL_DTYPE[dtype] if dtype.itemsize == 2 else acc
    pointers = dict(q_ptr=t, k_cache_ptr=t, v_cache_ptr=t, out_ptr=t)
    pointers |= dict(block_tables_ptr="i32", seq_lens_ptr="i32", query_start_loc_ptr="i32")
    constexprs = dict(
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        ACC_DTYPE=acc,
        DOT_DTYPE=dot,
        OFFSET_64=False,
    )
    label = (name, f"{heads}/{kv_heads} heads, d {head_dim}", t)
    return compile_sm90(
        tk._paged_attention_kernel,
        pointers,
        ("scale", "scale_residual"),
        constexprs,
        tiles.num_warps,
        tiles.num_stages,
        label,
    )


def store(kv_heads, head_dim, dtype) -> Compiled:
    t = TYPE[dtype]
    block_c = triton.next_power_of_2(kv_heads * head_dim)
    pointers = dict(k_ptr=t, v_ptr=t, k_cache_ptr=t, v_cache_ptr=t, slot_mapping_ptr="i32")
    constexprs = dict(
        NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_T=tk.store_tokens_per_program(block_c, interpreted=False),
        BLOCK_C=block_c,
        OFFSET_64=False,
    )
    label = ("store_kv", f"{kv_heads} kv heads, d {head_dim}", t)
    return compile_sm90(tk._store_kv_kernel, pointers, (), constexprs, 4, 1, label)


def fused(hidden, heads, kv_heads, head_dim, inner, dtype) -> list[Compiled]:
    """The fused norm, RoPE and activation kernels at their launch parameters."""
    t = TYPE[dtype]
    out = []
    for kernel, params, pointer_names, floats in tf.compile_specs(
        hidden, heads, kv_heads, head_dim, inner, dtype
    ):
        pointers = {name: (t if kind == "x" else kind) for name, kind in pointer_names.items()}
        label = (kernel.__name__.strip("_"), params.pop("_shape"), t)
        warps = params.pop("_num_warps")
        out.append(compile_sm90(kernel, pointers, floats, params, warps, 1, label))
    return out


def report(shapes=SHAPES, dtypes=DTYPES) -> list[Compiled]:
    """Every kernel at each of `shapes` (see SHAPES) in each of `dtypes`."""
    rows = []
    for hidden, heads, kv_heads, head_dim, inner in shapes:
        for dtype in dtypes:
            rows.append(attention(heads, kv_heads, head_dim, dtype, 1, "paged_attention decode"))
            rows.append(attention(heads, kv_heads, head_dim, dtype, 512, "paged_attention prefill"))
            rows.append(store(kv_heads, head_dim, dtype))
            rows += fused(hidden, heads, kv_heads, head_dim, inner, dtype)
    return rows


def markdown(rows: list[Compiled]) -> str:
    lines = [
        f"Triton {triton.__version__}, sm_90",
        "",
        "| kernel | shape | dtype | registers | spill bytes | shared bytes | warps | blocks/SM |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.kernel} | {r.shape} | {r.dtype} | {r.registers} | {r.spill_bytes} | "
            f"{r.shared_bytes} | {r.num_warps} | {r.blocks_per_sm} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[Compiled]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the rows (and the Triton version) here")
    p.add_argument("--head-dims", type=int, nargs="+", default=None, help="only these shapes")
    p.add_argument("--dtypes", nargs="+", choices=list(TYPE.values()), default=None)
    args = p.parse_args(argv)
    shapes = [s for s in SHAPES if args.head_dims is None or s[3] in args.head_dims]
    dtypes = [d for d in DTYPES if args.dtypes is None or TYPE[d] in args.dtypes]
    rows = report(shapes, dtypes)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"triton": triton.__version__, "rows": [asdict(r) for r in rows]}, f, indent=1
            )
    return rows


if __name__ == "__main__":
    main()
