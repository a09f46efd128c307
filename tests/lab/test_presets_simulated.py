"""The presets that rerun a claim on a simulated H100, end to end at a reduced
size: `servelab -m experiment=PRESET`, then `servelab-report`. A virtual clock
makes every figure deterministic, so each claim is asserted exactly, with no
retries."""

from __future__ import annotations

from PIL import Image

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


def test_speculative_decoding_h100(tmp_path):
    """Shorter outputs (64 tokens), batch 1 and 128: the same tokens with every proposer,
    fewer steps, free drafts and a Llama-3-8B draft pay at batch 1, and at batch 128 the
    8B draft's forwards cost more than its verifications save."""
    runs = run_preset(tmp_path, "speculative_decoding_h100", "workload.output_len.mean=64",
                      "engine.max_num_seqs=1,128")  # fmt: skip
    proposers = ("none", "simulated", "simulated_llama3_8b")
    assert set(runs) == {f"{p}/{b}" for p in proposers for b in (1, 128)}
    for batch in (1, 128):
        none, free, draft = (runs[f"{p}/{batch}"] for p in proposers)
        assert none["output_digest"] == free["output_digest"] == draft["output_digest"]
        assert free["steps"] == draft["steps"] < none["steps"]  # the same drafts
        assert free["spec_mean_accepted_length"] == draft["spec_mean_accepted_length"]
        assert draft["output_tok_s"] < free["output_tok_s"]  # its forwards cost time
    assert runs["simulated/1"]["steps"] <= 0.45 * runs["none/1"]["steps"]
    tok_s = {key: run["output_tok_s"] for key, run in runs.items()}
    assert tok_s["simulated/1"] >= 2 * tok_s["none/1"]
    assert tok_s["simulated_llama3_8b/1"] >= 1.25 * tok_s["none/1"]
    assert tok_s["simulated_llama3_8b/128"] < tok_s["none/128"] < tok_s["simulated/128"]
    with Image.open(tmp_path / "speculative_decoding_h100" / "speculation.png") as image:
        low, high = image.convert("L").getextrema()
        assert image.width > 100 and low < high


def test_kv_tiers_h100(tmp_path):
    """Fewer chats (their histories still outgrow the device cache): every tier
    computes fewer prompt tokens than none, host memory brings the first token
    sooner, and host over disk loads faster than the disk alone."""
    runs = run_preset(tmp_path, "kv_tiers_h100", "workload.num_conversations=32",
                      "engine.kv_cache_memory=2GiB")  # fmt: skip
    none, host, disk, tiered = (runs[t] for t in ("none", "host", "disk", "tiered"))
    for tier in (host, disk, tiered):
        assert tier["prefill_tokens"] <= 0.6 * none["prefill_tokens"]
        assert tier["tier_hit_rate"] > 0
    assert host["ttft_p50_ms"] < none["ttft_p50_ms"]
    assert tiered["tier_load_ms"] < disk["tier_load_ms"]
