"""The presets that rerun a claim on a simulated H100, end to end at a reduced
size: `servelab -m experiment=PRESET`, then `servelab-report`. A virtual clock
makes every figure deterministic, so each claim is asserted exactly, with no
retries."""

from __future__ import annotations

from tests.lab.test_presets import run_preset


def test_continuous_vs_static_h100(tmp_path):
    runs = run_preset(tmp_path, "continuous_vs_static_h100")
    continuous, static = runs["continuous"], runs["static"]
    assert continuous["steps"] <= 0.5 * static["steps"]
    # weight-bound decode steps: halving the steps nearly doubles the throughput
    assert continuous["output_tok_s"] >= 1.8 * static["output_tok_s"]
    assert continuous["decode_step_ms_mean"] <= 1.2 * static["decode_step_ms_mean"]


def test_chunked_prefill_h100(tmp_path):
    runs = run_preset(tmp_path, "chunked_prefill_h100", "workload.num_long=2",
                      "workload.decoder_output_len=128", "workload.long_every=0.3")  # fmt: skip
    chunked, whole = runs["chunked"], runs["continuous"]
    assert whole["longest_stall_prefill_tokens"] == 4096
    assert chunked["longest_stall_prefill_tokens"] == 512
    assert chunked["longest_stall_ms"] <= 0.5 * whole["longest_stall_ms"]
    assert chunked["itl_p99_ms"] <= 0.5 * whole["itl_p99_ms"]


def test_capacity_h100(tmp_path):
    runs = run_preset(tmp_path, "capacity_h100", "workload.num_requests=120",
                      "workload.rate=4", "scheduler=continuous,chunked")  # fmt: skip
    chunked, continuous = runs["chunked"], runs["continuous"]  # at 4 requests/s
    assert chunked["slo_attainment_pct"] >= 90 > continuous["slo_attainment_pct"]
    assert chunked["goodput_rps"] >= 1.5 * continuous["goodput_rps"]


def test_chunk_size_h100(tmp_path):
    runs = run_preset(tmp_path, "chunk_size_h100", "workload.num_requests=120",
                      "workload.rate=4", "scheduler.chunk_size=128,512,2048")  # fmt: skip
    small, mid, large = (runs[str(c)] for c in (128, 512, 2048))  # at 4 requests/s
    assert large["slo_attainment_pct"] < mid["slo_attainment_pct"]
    assert small["ttft_p50_ms"] > mid["ttft_p50_ms"]
