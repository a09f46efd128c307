"""LLMServingSim's attention.csv (small files written here in its published column
format, never the real data): its `kv_cache_size` meaning, the vectorised prices, and
that the attention fit recovers known figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from servelab.executor.cost_model import CostModel, Shape, StepShape
from servelab.executor.hardware import load_profile
from servelab.lab.calibrate_vidur import OpArrays, fit_attention
from servelab.lab.llmservingsim_data import read_llmservingsim
from tests.lab.test_vidur_data import write_rows

COLUMNS = ("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers", "max_model_len",
           "batch_size", "prefill_chunk_size", "kv_cache_size", "is_prefill", "attention_backend")  # fmt: skip
TRUTH = dict(attention_half_rows=150.0, attention_prefill_overhead=3e-6,
             attention_decode_overhead=4e-6, attention_stream_efficiency=0.6,
             attention_key_time=2.5e-8, attention_block_overhead=2e-8)  # fmt: skip


def _row(model: dict, batch, chunk, kv, prefill, ms):
    row = dict(zip(COLUMNS, (*model.values(), 4096, batch, chunk, kv, prefill, "FLASH_ATTENTION")))
    key = "prefill" if prefill else "decode"
    return {f"time_stats.attn_{key}.median": ms, f"time_stats.attn_{'decode' if prefill else 'prefill'}.median": "", **row}


MODELS = {"org/a": {"n_embd": 1024, "n_q_head": 16, "n_kv_head": 4, "tp": 2},
          "org/b": {"n_embd": 2048, "n_q_head": 16, "n_kv_head": 2, "tp": 1}}  # fmt: skip


def test_kv_cache_size_is_the_whole_context_and_the_batchs_keys_in_all(tmp_path):
    root = tmp_path / "llm_profile" / "perf_models"
    write_rows(root / "H100" / "org" / "a" / "tp2" / "attention.csv", [
        _row(MODELS["org/a"], 1, 64, 96, True, 0.01),  # 64 new tokens after 32 cached
        _row(MODELS["org/a"], 4, 0, 400, False, 0.02),  # 4 decodes of 100 keys each
        _row(MODELS["org/a"], 8, 0, 4, False, 0.02),  # fewer keys than sequences: skipped
    ])  # fmt: skip
    ops = read_llmservingsim(tmp_path, "H100")
    assert len(ops) == 2 and set(ops.columns["model"]) == {"org/a/tp2"}
    shape = Shape(1024, 0, 1, 16, 4, 64, 1)
    cost = CostModel(shape, load_profile("h100-sxm"), "float16", 2, 2)
    (prefill,) = cost.attention_ops(StepShape(np.array([64.0]), np.array([32.0]), np.zeros(0), 1))
    (decode,) = cost.attention_ops(StepShape(np.zeros(0), np.zeros(0), np.full(4, 100.0), 4))
    assert ops.columns["flops"] == [prefill.flops, decode.flops]
    assert ops.columns["span"] == [96.0, 100.0] and ops.columns["blocks"] == [8.0, 32.0]
    assert ops.columns["seconds"] == pytest.approx([10e-6, 20e-6])


def _synthetic(tmp_path: Path, truth) -> Path:
    root = tmp_path / "perf_models"
    for name, m in MODELS.items():
        shape = Shape(m["n_embd"], 0, 1, m["n_q_head"], m["n_kv_head"], m["n_embd"] // m["n_q_head"], 1)
        cost = CostModel(shape, truth, "float16", 2, m["tp"])
        rows = []
        for chunk in (32, 128, 320, 1024):
            for total in (chunk, chunk + 500, chunk + 2000):
                (op,) = cost.attention_ops(StepShape(np.array([chunk * 1.0]), np.array([total - chunk * 1.0]), np.zeros(0), 1))
                rows.append(_row(m, 1, chunk, total, True, cost.op_time(op) * 1e3))
        for batch in (1, 4, 16, 64, 256):
            for total in (512, 8192, 65536):
                keys = total // batch
                (op,) = cost.attention_ops(StepShape(np.zeros(0), np.zeros(0), np.full(batch, keys * 1.0), batch))
                rows.append(_row(m, batch, 0, total, False, cost.op_time(op) * 1e3))
        columns = dict(zip(("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers"), m.values()))
        write_rows(root / "H100" / name / f"tp{m['tp']}" / "attention.csv",
               [{**r, **columns} for r in rows])  # fmt: skip
    return root


def test_the_vectorised_prices_equal_the_cost_models(tmp_path):
    truth = dataclasses.replace(load_profile("h100-sxm"), **TRUTH)
    ops = read_llmservingsim(_synthetic(tmp_path, truth), "H100")
    assert OpArrays(ops).predict(truth) == pytest.approx(OpArrays(ops).seconds, rel=1e-9)


def test_the_attention_fit_recovers_known_figures(tmp_path):
    truth = dataclasses.replace(load_profile("h100-sxm"), **TRUTH)
    root = _synthetic(tmp_path, truth)
    start = dataclasses.replace(truth, attention_stream_efficiency=0.0, attention_key_time=0.0,
                                attention_block_overhead=0.0)  # fmt: skip
    fitted, sources = fit_attention(start, read_llmservingsim(root, "H100"), root, "test", "abc")
    for name in ("attention_stream_efficiency", "attention_key_time", "attention_block_overhead"):
        assert getattr(fitted, name) == pytest.approx(TRUTH[name], rel=0.05), name
    assert fitted.matmul_efficiency == truth.matmul_efficiency  # the rest as it was
    assert "commit abc" in sources["attention"] and "H100/org/a/tp2/attention.csv" in sources["attention"]
