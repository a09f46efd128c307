"""LLMServingSim's profile bundles (small files written here in its published format,
never the real data): what each row becomes, that the vectorised prices are the cost
model's, and that the fit recovers known figures and picks the kernel that made them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from servelab.executor.cost_model import CostModel, Shape, StepShape
from servelab.executor.hardware import load_profile
from servelab.lab.calibrate_llmservingsim import fit_from_llmservingsim, split_attention
from servelab.lab.calibrate_vidur import OpArrays
from servelab.lab.llmservingsim_data import KERNELS, dense_ops, read_bundles
from tests.lab.test_vidur_data import write_rows

# two tiny decoders (Hugging Face config.json fields), one per org
CONFIGS = {
    "org/a": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": 1000, "num_hidden_layers": 2},
    "org/b": {"hidden_size": 384, "intermediate_size": 1024, "num_attention_heads": 12,
              "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 1500},
}  # fmt: skip
KERNEL = KERNELS["vllm-fa2"]
TRUTH = dict(
    matmul_efficiency=0.6, matmul_half_rows=50.0, bandwidth_efficiency=0.8, matmul_overhead=4e-6,
    elementwise_full_rows=100.0, launch_overhead=1.5e-6, l2_bytes=2e6,
    kernel_efficiency={"rms_norm": 2.5, "rope": 1.6, "activation": 3.0, "residual_add": 3.0},
    attention_efficiency=0.45, attention_half_rows=60.0, attention_prefill_overhead=5e-6,
    attention_decode_overhead=8e-6, attention_stream_efficiency=0.9, attention_key_time=2e-8,
    attention_block_overhead=3e-8, attention_wave_blocks=400.0, attention_sms=188.0,
    attention_tile_time=3e-6, attention_empty_block_time=4e-7, **KERNEL,
)  # fmt: skip
DENSE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "rotary_emb", "act_fn", "layernorm",
         "final_layernorm")  # fmt: skip
TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096)


def _shape(config: dict) -> Shape:
    heads = config["num_attention_heads"]
    return Shape(config["hidden_size"], config["intermediate_size"],
                 config.get("num_hidden_layers", 1), heads, config["num_key_value_heads"],
                 config.get("head_dim") or config["hidden_size"] // heads, config["vocab_size"])  # fmt: skip


def _attention_seconds(model: CostModel, chunk, cached, decodes, history) -> float:
    prefill, start = (np.array([chunk]), np.array([cached])) if chunk else (np.zeros(0), np.zeros(0))
    step = StepShape(prefill, start, np.full(decodes, history + 1.0), decodes + bool(chunk))
    return sum(model.op_time(op) for op in model.attention_ops(step))


def write_bundles(tmp_path: Path, truth, gpu: str = "GPUX") -> Path:
    """A checkout with configs/model and profiler/perf/<gpu>/<org>/<m>/bf16/tp{1,2}/, every
    time the cost model's under `truth` (the layernorms of tp2 copied from tp1, and rows
    of the kernels the cost model does not price, which the reader must skip)."""
    for name, config in CONFIGS.items():
        path = tmp_path / "configs" / "model" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config))
        shape = _shape(config)
        for tp in (1, 2):
            folder = tmp_path / "profiler" / "perf" / gpu / name / "bf16" / f"tp{tp}"
            model = CostModel(shape, truth, "float16", 2, tp)
            dense = []
            for layer in DENSE:
                for tokens in TOKENS:
                    seconds = sum(model.op_time(op) for op in dense_ops(shape, 1 if "layernorm" in layer else tp, layer, tokens))
                    dense.append({"layer": layer, "tokens": tokens, "time_us": seconds * 1e6})
            dense += [{"layer": "qk_norm", "tokens": 8, "time_us": 9.0},
                      {"layer": "embedding", "tokens": 8, "time_us": 3.0}]  # fmt: skip
            write_rows(folder / "dense.csv", dense)
            per_sequence = [{"layer": "sampler", "sequences": 1, "time_us": 20.0}]
            for s in (1, 8, 64, 256):
                step = StepShape(np.zeros(0), np.zeros(0), np.zeros(0), s)
                (op,) = [op for op in model.step_ops(step) if op.name == "lm_head"]
                per_sequence.append({"layer": "lm_head", "sequences": s, "time_us": model.op_time(op) * 1e6})
            write_rows(folder / "per_sequence.csv", per_sequence)
            rows = [{"prefill_chunk": 0, "kv_prefill": 0, "n_decode": 0, "kv_decode": 0, "time_us": 1.0}]
            for chunk in (0, 16, 256, 1024):
                for cached in ((0,) if not chunk else (0, 512, 4096)):
                    for decodes in (0, 1, 8, 64, 256):
                        for history in ((0,) if not decodes else (16, 1024, 8192)):
                            if chunk or decodes:
                                seconds = _attention_seconds(model, chunk, cached, decodes, history)
                                rows.append({"prefill_chunk": chunk, "kv_prefill": cached, "n_decode": decodes,
                                             "kv_decode": history, "time_us": seconds * 1e6})  # fmt: skip
            write_rows(folder / "attention.csv", rows)
    return tmp_path


def _truth():
    return dataclasses.replace(load_profile("rtx-pro-6000"), **TRUTH)


def test_each_row_becomes_the_cost_models_ops(tmp_path):
    root = write_bundles(tmp_path, _truth())
    ops = read_bundles(root, "GPUX", kernel=KERNEL)
    table = OpArrays(ops)
    labels = set(table.call.tolist())
    assert labels == {*DENSE, "lm_head", "prefill", "decode", "mixed"}  # qk_norm, embedding, sampler: not read
    a = np.array(ops.columns["model"]) == "org/a"
    layernorm = [i for i, (m, lab, tp) in enumerate(zip(ops.columns["model"], ops.columns["label"], ops.columns["tp"]))
                 if m == "org/a" and lab == "layernorm"]  # fmt: skip
    # the fused add + RMSNorm: an RMSNorm and a residual add priced together, one launch,
    # and half its residual read after the qkv and o weights streamed (`residual_rereads`);
    # tp2's copy of tp1's rows is read once
    assert len(layernorm) == 3 * len(TOKENS)
    assert [ops.columns["name"][i] for i in layernorm[:3]] == ["rms_norm", "residual_add",
                                                                "residual_reread"]  # fmt: skip
    assert [ops.columns["launches"][i] for i in layernorm[:3]] == [1.0, 0.0, 0.0]
    assert ops.columns["group"][layernorm[0]] == ops.columns["group"][layernorm[2]]
    # a mixed row: one call (attention_unified) over the chunk and the decodes' history + 1 keys
    mixed = [i for i in np.flatnonzero(a) if ops.columns["label"][i] == "mixed"]
    assert {ops.columns["name"][i] for i in mixed} == {"attention_mixed"}
    shape = _shape(CONFIGS["org/a"])
    step = StepShape(np.array([16.0]), np.array([0.0]), np.full(1, 17.0), 2)
    (op,) = CostModel(shape, _truth(), "float16", 2, 1).attention_ops(step)
    assert ops.columns["flops"][mixed[0]] == op.flops and ops.columns["blocks"][mixed[0]] == op.blocks
    assert len(ops) == len(table.seconds)


def test_the_vectorised_prices_equal_the_cost_models(tmp_path):
    truth = _truth()
    ops = read_bundles(write_bundles(tmp_path, truth), "GPUX", kernel=KERNEL)
    table = OpArrays(ops)
    assert table.predict(truth) == pytest.approx(table.seconds, rel=1e-6)


def test_the_fit_recovers_known_figures_and_the_kernel(tmp_path):
    truth = _truth()
    root = write_bundles(tmp_path, truth)
    start = load_profile("rtx-pro-6000")  # datasheet figures, another kernel's structure
    fitted, sources = fit_from_llmservingsim(start, root, "GPUX", "abc")
    assert fitted.attention_gqa_packing == 1.0 and fitted.attention_unified == 1.0
    # every figure these rows bind (the attention grid here leaves its stream and curve free)
    for name in ("matmul_efficiency", "matmul_half_rows", "bandwidth_efficiency",
                 "matmul_overhead", "elementwise_full_rows", "launch_overhead", "l2_bytes",
                 "attention_prefill_overhead", "attention_decode_overhead",
                 "attention_key_time", "attention_block_overhead"):  # fmt: skip
        assert getattr(fitted, name) == pytest.approx(TRUTH[name], rel=0.05), name
    assert fitted.kernel_efficiency == pytest.approx(TRUTH["kernel_efficiency"], rel=0.01)
    ops = read_bundles(root, "GPUX", kernel=KERNEL)
    table = OpArrays(ops)
    errors = np.abs(table.predict(fitted) / table.seconds - 1)
    assert np.median(errors) < 0.01
    assert "commit abc" in sources["measured"] and "kernel vllm-fa2" in sources["attention"]
    assert "GPUX/org/a/bf16/tp1" in sources["measured"]
    dense, attention = split_attention(ops)
    assert len(dense) + len(attention) == len(ops)


def test_the_fit_recovers_the_paged_kernels_tiles(tmp_path):
    """Calls with a chunk priced by vLLM's paged kernel (`attention_sms`): the fit recovers
    its tile and empty-block figures, and without them misses the chunk-beside-decodes
    calls (their padded grids, their decodes' whole tiles and re-read K/V)."""
    root = write_bundles(tmp_path, _truth())
    start = load_profile("rtx-pro-6000")
    fitted, _ = fit_from_llmservingsim(start, root, "GPUX", "abc")
    for name in ("attention_tile_time", "attention_empty_block_time"):
        assert getattr(fitted, name) == pytest.approx(TRUTH[name], rel=0.05), name
    table = OpArrays(read_bundles(root, "GPUX", kernel=KERNEL))
    mixed = table.call == "mixed"

    def mixed_error(profile):
        return float(np.median(np.abs(table.predict(profile)[mixed] / table.seconds[mixed] - 1)))

    blind, _ = fit_from_llmservingsim(dataclasses.replace(start, attention_sms=0.0), root, "GPUX", "abc")
    assert mixed_error(fitted) < 0.01 and mixed_error(blind) > 0.05
