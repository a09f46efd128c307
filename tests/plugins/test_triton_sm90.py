"""Every Triton kernel compiles for Hopper (sm_90) without register spills, at
every head size and dtype the engine launches it with, under the Triton installed
here and, where `SERVELAB_SM90_TRITON_VENV` names a virtual environment holding
another Triton (the GPU image's: 3.6), under that one too; the decode attention
kernel leaves room for at least 4 blocks per SM at head sizes up to 128 in 16-
and 32-bit types. Compiled on the CPU with the CUDA assembler Triton ships
(`benchmarks/triton_registers.py`, in its own process: this one's kernels may be
defined interpreted; the other Triton goes first on that process's path)."""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OTHER_TRITON = "SERVELAB_SM90_TRITON_VENV"
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
HEAD_DIMS = (128, 16, 64, 256)  # the script's SHAPES
DTYPES = ("bf16", "fp16", "fp32", "fp64")


def other_triton_site() -> str:
    """The site-packages of the venv `SERVELAB_SM90_TRITON_VENV` names, or a skip."""
    venv = os.environ.get(OTHER_TRITON)
    if not venv:
        pytest.skip(
            f"{OTHER_TRITON} is not set: to check another Triton (the GPU image's 3.6), "
            f"make a venv with `pip install triton==3.6.0` under {PY} and name it there"
        )
    found = glob.glob(os.path.join(venv, "lib", PY, "site-packages", "triton", "__init__.py"))
    if not found:
        pytest.skip(f"{OTHER_TRITON}={venv} holds no triton for {PY} (lib/{PY}/site-packages)")
    return str(Path(found[0]).parents[1])


def ptxas_problem() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception as err:  # an install without the NVIDIA backend
        return f"Triton's NVIDIA backend is missing: {err}"
    return None if path and os.path.exists(path) else "Triton ships no ptxas here"


@pytest.fixture(scope="module", params=["installed", "other"], ids=["installed", "other"])
def report(request, tmp_path_factory) -> dict:
    """{"triton": version, "rows": [...]} of the script under one Triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default both versions compile with
    if request.param == "other":
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [other_triton_site(), env.get("PYTHONPATH")])
        )
    else:
        problem = ptxas_problem()
        if problem:
            pytest.skip(problem)
    out = tmp_path_factory.mktemp("sm90") / "rows.json"
    script = ROOT / "benchmarks" / "triton_registers.py"
    done = subprocess.run(
        [sys.executable, str(script), "--json", str(out)],
        env=env, cwd=ROOT, timeout=1800, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)  # the table, with -s
    return {"which": request.param, **json.loads(out.read_text())}


def test_the_intended_triton_compiled(report):
    """The script's Triton is the one asked for: this process's, or the venv's
    (read from its dist-info folder, not by importing it)."""
    if report["which"] == "installed":
        expected = importlib.metadata.version("triton")
    else:
        (info,) = glob.glob(os.path.join(other_triton_site(), "triton-*.dist-info"))
        expected = os.path.basename(info).removeprefix("triton-").removesuffix(".dist-info")
    assert report["triton"] == expected


def test_every_kernel_compiles_at_every_shape(report):
    rows = report["rows"]
    kernels = {r["kernel"] for r in rows}
    assert kernels == {
        "paged_attention decode",
        "paged_attention prefill",
        "store_kv",
        "add_rms_norm_kernel",
        "qk_norm_rope_kernel",
        "silu_mul_kernel",
    }
    for kernel in kernels:
        combos = {
            (r["dtype"], r["shape"].rsplit("d ", 1)[-1]) for r in rows if r["kernel"] == kernel
        }
        expected = {(d, str(h)) for d in DTYPES for h in HEAD_DIMS}
        if kernel in ("add_rms_norm_kernel", "silu_mul_kernel"):  # no head size in the shape
            combos = {d for d, _ in combos}
            expected = set(DTYPES)
        assert combos == expected, kernel


def test_no_kernel_spills_registers(report):
    spilled = [r for r in report["rows"] if r["spill_bytes"]]
    assert not spilled, f"Triton {report['triton']}: {spilled}"


def test_decode_attention_keeps_four_blocks_per_sm(report):
    decode = [
        r
        for r in report["rows"]
        if r["kernel"] == "paged_attention decode"
        and r["dtype"] != "fp64"
        and int(r["shape"].rsplit("d ", 1)[-1]) <= 128
    ]
    assert len(decode) == 3 * 3
    assert all(r["blocks_per_sm"] >= 4 and r["registers"] <= 128 for r in decode), decode
