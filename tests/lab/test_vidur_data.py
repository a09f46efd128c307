"""Reading Vidur's profiling CSVs (small files written here in its column format,
never the real data) into cost-model ops, and fitting a profile to them."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from servelab.errors import ConfigError
from servelab.executor.cost_model import CostModel, Op, Shape
from servelab.executor.hardware import load_profile
from servelab.lab.vidur_data import read_vidur

KERNELS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
           "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")  # fmt: skip
STATS = ("min", "max", "mean", "median", "std")
# a tiny gated decoder: h = 64, 4 query heads, 2 KV heads (d = 16), I = 96
TINY = {"n_head": 4, "n_kv_head": 2, "n_embd": 64, "n_expanded_embd": 96, "vocab_size": 100}
TRUTH = dict(
    matmul_efficiency=0.6, matmul_half_rows=50.0, bandwidth_efficiency=0.8, matmul_overhead=5e-6,
    elementwise_full_rows=120.0, launch_overhead=1e-6,
    kernel_efficiency={"rms_norm": 0.35, "rope": 0.45, "activation": 0.55, "residual_add": 0.9},
    interconnect_latency=25e-6, interconnect_bandwidth=500e9, interconnect_half_bytes=2e6,
    interconnect_latency_per_device=1e-6, interconnect_curve_exponent=0.6,
)  # fmt: skip


def write_rows(path: Path, rows: list[dict]) -> None:
    """`rows` as a CSV file with their keys as the header (the published profiles' shape)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _mlp_row(shape: dict, tp: int, tokens: int, ms: dict[str, float], gated=True) -> dict:
    row = {f"time_stats.{k}.{s}": ms.get(k, 0.001) for k in KERNELS for s in STATS}
    return {**row, **shape, "use_gated_mlp": gated, "num_tokens": tokens,
            "num_tensor_parallel_workers": tp}  # fmt: skip


def test_an_mlp_row_becomes_the_cost_models_ops(tmp_path):
    root = tmp_path / "profiling"
    times = {"attn_pre_proj": 0.012, "mlp_act": 0.003}
    write_rows(root / "compute" / "h100" / "org" / "tiny" / "mlp.csv", [
        _mlp_row(TINY, 2, 8, times),
        _mlp_row({**TINY, "n_head": 8}, 1, 8, times, gated=False),  # not gated: skipped
    ])  # fmt: skip
    ops, collectives = read_vidur(root, "h100", None)
    assert collectives is None
    names = ops.columns["name"]
    # nine timed kernels (the embedding is not a layer op); two norms
    assert (
        len(ops) == 9 and names.count("rms_norm") == 2 and set(ops.columns["model"]) == {"org/tiny"}
    )
    qkv = names.index("qkv_proj")
    # TP 2: (2 + 2 x 1) heads x 16 = 64 columns; 2 x 8 x 64 x 64 flops; 2 bytes x (64 x 64 + 8 x 64 + 8 x 64)
    assert ops.columns["flops"][qkv] == 2 * 8 * 64 * 64
    assert ops.columns["bytes"][qkv] == 2 * (64 * 64 + 8 * 64 + 8 * 64)
    assert ops.columns["seconds"][qkv] == pytest.approx(12e-6)  # milliseconds in the file
    act = names.index("activation")  # SiLU x up on I / p = 48: read 2 x 48, write 48
    assert ops.columns["bytes"][act] == 2 * 8 * 3 * 48 and ops.columns["seconds"][
        act
    ] == pytest.approx(3e-6)
    assert ops.columns["kind"][act] == "elementwise" and ops.columns["rows"][act] == 8


def test_attention_and_all_reduce_rows(tmp_path):
    root = tmp_path / "profiling"
    shape = {"n_embd": 64, "n_q_head": 4, "n_kv_head": 2, "num_tensor_parallel_workers": 1}
    write_rows(root / "compute" / "a100" / "org" / "tiny" / "attention.csv", [
        {"time_stats.attn_prefill.median": 0.02, "time_stats.attn_decode.median": "", **shape,
         "batch_size": 1, "prefill_chunk_size": 32, "kv_cache_size": 16, "is_prefill": True},
        {"time_stats.attn_prefill.median": "", "time_stats.attn_decode.median": 0.03, **shape,
         "batch_size": 4, "prefill_chunk_size": 0, "kv_cache_size": 100, "is_prefill": False},
    ])  # fmt: skip
    write_rows(root / "network" / "a100_dgx" / "all_reduce.csv", [
        {"time_stats.all_reduce.median": 0.03, "num_workers": 4, "devices_per_node": 4,
         "size": 1024, "collective": "all_reduce", "rank": 0},
        {"time_stats.all_reduce.median": 0.05, "num_workers": 8, "devices_per_node": 4,
         "size": 1024, "collective": "all_reduce", "rank": 0},  # two nodes: skipped
    ])  # fmt: skip
    ops, collectives = read_vidur(root, "a100", "a100_dgx")
    assert ops.columns["name"] == ["attention_prefill", "attention_decode"]
    assert ops.columns["call"] == ["prefill", "decode"]
    # 32 queries after 16 cached: 4 d H (q s + q (q + 1) / 2) = 4 x 16 x 4 x (512 + 528)
    assert ops.columns["flops"][0] == 4 * 16 * 4 * (32 * 16 + 32 * 33 / 2)
    assert ops.columns["flops"][1] == 4 * 16 * 4 * 4 * 100  # 4 decodes over 100 keys
    # `size` is bytes (Vidur's rule: a token of hidden size h is 2 h of them)
    assert collectives.bytes.tolist() == [1024.0] and collectives.devices.tolist() == [4.0]
    assert collectives.seconds.tolist() == pytest.approx([30e-6])


def test_a_missing_folder_names_what_is_expected(tmp_path):
    (tmp_path / "compute" / "a100").mkdir(parents=True)
    with pytest.raises(ConfigError, match="devices there: a100"):
        read_vidur(tmp_path, "h100", None)
    with pytest.raises(ConfigError, match="no mlp.csv or attention.csv"):
        read_vidur(tmp_path, "a100", None)


def _synthetic_profiling(root: Path, truth) -> None:
    """mlp.csv rows of two 7B-13B-sized shapes (large enough to be compute bound at
    large token counts) and all_reduce rows, timed by `truth` through the scalar cost
    model (the fit reads them through its vectorised form)."""
    small = {
        "n_head": 32,
        "n_kv_head": 8,
        "n_embd": 4096,
        "n_expanded_embd": 11008,
        "vocab_size": 100,
    }
    large = {**small, "n_head": 40, "n_embd": 5120, "n_expanded_embd": 13824}
    for name, shape in (("small", small), ("large", large)):
        rows = []
        for tp in (1, 2):
            for tokens in (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096):
                cost = CostModel(Shape(shape["n_embd"], shape["n_expanded_embd"], 1, shape["n_head"],
                                       shape["n_kv_head"], shape["n_embd"] // shape["n_head"], 100),
                                 truth, "float16", 2, tp)  # fmt: skip
                from servelab.lab.vidur_data import linear_and_elementwise_ops

                ops = linear_and_elementwise_ops(cost.shape, tp, tokens)
                ms = {k: cost.op_time(op) * 1e3 for k, op in ops.items()}
                rows.append(_mlp_row(shape, tp, tokens, ms))
        write_rows(root / "compute" / "h100" / "org" / name / "mlp.csv", rows)
    rows = []
    for p in (2, 4, 8):
        for tokens in (1, 4, 16, 64, 256, 1024, 4096, 16384):
            # Vidur's rule: T tokens of hidden size h are the row of size 2 T h (bytes)
            model = CostModel(Shape(HIDDEN, 1, 1, 1, 1, 1, 1), truth, "float16", 2, p)
            rows.append({"time_stats.all_reduce.median": model.all_reduce_time(tokens) * 1e3,
                         "num_workers": p, "devices_per_node": p, "size": 2 * tokens * HIDDEN,
                         "collective": "all_reduce"})  # fmt: skip
    write_rows(root / "network" / "h100_dgx" / "all_reduce.csv", rows)


HIDDEN = 4096


def test_the_fit_recovers_a_known_profile_and_names_its_sources(tmp_path):
    from servelab.lab.calibrate import main

    base = load_profile("h100-sxm")
    truth = dataclasses.replace(base, **TRUTH)
    _synthetic_profiling(tmp_path / "profiling", truth)
    out = tmp_path / "fitted.yaml"
    main(["--profile", "h100-sxm", "--from-vidur", str(tmp_path / "profiling"),
          "--vidur-commit", "abc123", "--out", str(out)])  # fmt: skip
    fitted = load_profile(str(out))
    for name, value in TRUTH.items():
        if name == "kernel_efficiency":
            for kernel, eff in value.items():
                assert fitted.kernel_efficiency[kernel] == pytest.approx(eff, rel=0.02), kernel
        else:
            assert getattr(fitted, name) == pytest.approx(value, rel=0.02), name
    assert fitted.basis == "measured"
    assert "microsoft/vidur" in fitted.sources["fitted"] and "abc123" in fitted.sources["fitted"]
    assert "compute/h100/org/small/mlp.csv" in fitted.sources["fitted"]
    assert "4 files" not in fitted.sources["fitted"] and "2 files" in fitted.sources["fitted"]
    assert "network/h100_dgx/all_reduce.csv" in fitted.sources["interconnect"]
    # the fitted profile prices a step's all-reduce as the row Vidur's rule maps it to
    for p, tokens in ((4, 64), (8, 4096)):
        want = CostModel(Shape(HIDDEN, 1, 1, 1, 1, 1, 1), truth, "bfloat16", 2, p)
        got = CostModel(Shape(HIDDEN, 1, 1, 1, 1, 1, 1), fitted, "bfloat16", 2, p)
        assert got.all_reduce_time(tokens) == pytest.approx(want.all_reduce_time(tokens), rel=1e-3)


def test_an_op_of_a_measured_kernel_is_priced_alike_by_both_forms():
    from servelab.lab.op_times import op_times

    profile = dataclasses.replace(load_profile("h100-sxm"), **TRUTH)
    cost = CostModel(Shape(64, 96, 1, 4, 2, 16, 100), profile, "float16", 2)
    ops = [Op("rope", "elementwise", 0, 4096, rows=16), Op("rms_norm", "elementwise", 0, 1e6, rows=900),
           Op("x", "matmul", 1e9, 1e6, rows=64, call="matmul")]  # fmt: skip
    vector = op_times(profile, "float16", *(np.array([getattr(op, k) for op in ops]) for k in
                      ("kind", "flops", "bytes", "rows", "launches", "call", "name")))  # fmt: skip
    np.testing.assert_allclose(vector, [cost.op_time(op) for op in ops], rtol=1e-12)
