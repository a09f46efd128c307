"""Every Triton kernel compiles for Hopper (sm_90) without register spills, at
the Qwen3-0.6B shapes and the tiny test model's, in bf16 and fp32, and the
decode attention kernel leaves room for at least 4 blocks per SM. Compiled on
the CPU with the CUDA assembler Triton ships (`benchmarks/triton_registers.py`,
in its own process: this one's kernels may be defined interpreted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ptxas_problem() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception as err:  # an install without the NVIDIA backend
        return f"Triton's NVIDIA backend is missing: {err}"
    return None if path and os.path.exists(path) else "Triton ships no ptxas here"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    problem = ptxas_problem()
    if problem:
        pytest.skip(problem)
    out = tmp_path_factory.mktemp("sm90") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = ROOT / "benchmarks" / "triton_registers.py"
    subprocess.run(
        [sys.executable, str(script), "--tiny", "--json", str(out)],
        check=True, env=env, cwd=ROOT, timeout=600, capture_output=True,
    )  # fmt: skip
    return json.loads(out.read_text())


def test_every_kernel_compiles_at_every_shape(rows):
    kernels = {r["kernel"] for r in rows}
    assert kernels == {
        "paged_attention decode",
        "paged_attention prefill",
        "store_kv",
        "add_rms_norm_kernel",
        "qk_norm_rope_kernel",
        "silu_mul_kernel",
    }
    assert {(r["dtype"], r["shape"]) for r in rows if r["kernel"] == "store_kv"} == {
        (d, s) for d in ("bf16", "fp32") for s in ("8 kv heads, d 128", "2 kv heads, d 16")
    }


def test_no_kernel_spills_registers(rows):
    spilled = [r for r in rows if r["spill_bytes"]]
    assert not spilled, spilled


def test_decode_attention_keeps_four_blocks_per_sm(rows):
    decode = [r for r in rows if r["kernel"] == "paged_attention decode"]
    assert len(decode) == 4
    assert all(r["blocks_per_sm"] >= 4 and r["registers"] <= 128 for r in decode), decode
