"""What a decode step's matmuls stream on this CPU, per weight dtype: the Qwen3-0.6B
shape's 28 layers of projections (distinct weights, so they come from DRAM as in a
real step) and its LM head, through servelab's CPU matmul path
(`servelab.executor.kernel_forward.PackedMatmul`) at a few rows, against the read
bandwidth `cpu_real_size.py` measures, in the same run.

    python benchmarks/cpu_decode_matmuls.py [--rows 1 4 8 64] [--threads 2] [--repeats 5]
        [--layers 28] [--vocab 151936]

A decode step at batch 1 must read every weight once, so weight bytes / step time
is the bandwidth the step reaches. It also times oneDNN over the plain (not
prepacked) bfloat16 weight beside the path's own. The CPU's model and flags head the output.
"""

from __future__ import annotations

import argparse

import torch
from cpu_real_size import SHAPES, _best, _read_bandwidth

from servelab.executor.kernel_forward import PackedMatmul
from servelab.kernels import huge_pages
from servelab.kernels.cpu_matmul import cpu_flags
from servelab.lab.provenance import cpu_model

SHAPE = SHAPES["qwen3-0.6b"].config()  # the shape cpu_real_size.py serves
HIDDEN, LAYERS, VOCAB = SHAPE.hidden_size, SHAPE.num_layers, SHAPE.vocab_size
PROJECTIONS = [  # (out, in) of qkv, o, gate_up, down
    ((SHAPE.num_heads + 2 * SHAPE.num_kv_heads) * SHAPE.head_dim, HIDDEN),
    (HIDDEN, SHAPE.num_heads * SHAPE.head_dim),
    (2 * SHAPE.intermediate_size, HIDDEN),
    (HIDDEN, SHAPE.intermediate_size),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=LAYERS, help="fewer: a smaller test")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="the LM head's rows")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    flags = sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    print(f"CPU: {cpu_model()} ({', '.join(flags)}); {args.threads} threads; read bandwidth "
          f"{_read_bandwidth() / 1e9:.1f} GB/s (cpu_real_size.py's measure)")  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        for line in dtype_lines(dtype, args):
            print(line, flush=True)


def path_name(matmul: PackedMatmul, rows: int) -> str:
    """The path a projection of `rows` rows takes (one bf16 row: servelab's row kernel)."""
    if rows == 1 and matmul.bf16_row is not None:
        return "servelab bf16 row kernel"
    return matmul.path.name


def dtype_lines(dtype: torch.dtype, args) -> list[str]:
    """One line per row count: the projections' and the LM head's time and weight GB/s."""
    size = torch.tensor([], dtype=dtype).element_size()
    # on 2 MiB pages, as the engine's model holds its weights
    plain = [[huge_pages.copy(torch.randn(n, k).to(dtype)) for n, k in PROJECTIONS]
             for _ in range(args.layers)]  # fmt: skip
    packed = [[PackedMatmul(w, None) for w in layer] for layer in plain]
    head = PackedMatmul(huge_pages.copy(torch.randn(args.vocab, HIDDEN).to(dtype)), None)
    layer_bytes = sum(n * k for n, k in PROJECTIONS) * args.layers * size
    head_bytes = args.vocab * HIDDEN * size
    lines = []
    for rows in args.rows:
        xs = [torch.randn(rows, k) for _, k in PROJECTIONS]
        x_head = torch.randn(rows, HIDDEN)
        t_layers = _best(lambda xs=xs: [m(x) for layer in packed for m, x in zip(layer, xs)],
                        args.repeats)
        t_head = _best(lambda x_head=x_head: head(x_head), args.repeats)
        line = (f"{str(dtype)[6:]:>8} rows {rows:>3}: projections {t_layers * 1e3:7.2f} ms "
                f"({layer_bytes / t_layers / 1e9:5.1f} GB/s), LM head {t_head * 1e3:6.2f} ms "
                f"({head_bytes / t_head / 1e9:5.1f} GB/s), path {path_name(packed[0][0], rows)}")  # fmt: skip
        if dtype == torch.bfloat16:  # oneDNN over the plain layout, for comparison
            xb = [x.to(dtype) for x in xs]
            t_plain = _best(lambda xb=xb: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none",
                                                                           [], "")
                                           for layer in plain for w, x in zip(layer, xb)],
                            args.repeats)  # fmt: skip
            line += f"; oneDNN over the plain weight: {t_layers / t_plain:.2f}x this path's speed"
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
