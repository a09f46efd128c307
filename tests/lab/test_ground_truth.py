"""Measured serving runs (small files written here in inference-sim's and LLMServingSim's
published formats, never the real data): what the readers take from them, and that a
replay serves every request through the simulated executor with the run's settings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from servelab.lab.ground_truth import (
    find_runs,
    read_inference_sim,
    read_llmservingsim_bench,
    replay,
    replay_config,
    unsupported,
)

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 500, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}  # fmt: skip


def _span(start: float, prompt: int, output: int, ttft: float, e2e: float) -> dict:
    values = {"gen_ai.latency.time_to_first_token": {"doubleValue": ttft},
              "gen_ai.latency.e2e": {"doubleValue": e2e},
              "gen_ai.usage.prompt_tokens": {"intValue": str(prompt)},
              "gen_ai.usage.completion_tokens": {"intValue": str(output)}}  # fmt: skip
    return {"name": "llm_request", "startTimeUnixNano": str(int(start * 1e9)),
            "endTimeUnixNano": str(int((start + e2e) * 1e9)),
            "attributes": [{"key": k, "value": v} for k, v in values.items()]}  # fmt: skip


def write_inference_sim(root: Path, prefix: int = 16) -> Path:
    """A checkout's eval/ground_truth/<run>/ and model_configs/ (one OTLP document a line)."""
    config = root / "model_configs" / "tiny-llama" / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(TINY))
    run = root / "eval" / "ground_truth" / "run-1"
    run.mkdir(parents=True)
    (run / "exp-config.yaml").write_text("model: org/Tiny-Llama\ntensor_parallelism: 1\n"
                                         "max_model_len: 1024\nmax_num_batched_tokens: 64\n"
                                         "max_num_seqs: 8\napp: test\n")  # fmt: skip
    (run / "profile.yaml").write_text(f"rate-type: sweep\ndata:\n  prefix_tokens: {prefix}\n")
    (run / "vllm.log").write_text(
        "INFO vllm.entrypoints.openai.api_server: vLLM API server version 0.11.0\n"
        "INFO vllm.v1.engine.core: Initializing ... max_seq_len=2048, ... enable_prefix_caching=True, ...\n"
        "INFO vllm.v1.core.kv_cache_utils: GPU KV cache size: 4,096 tokens\n"
    )  # fmt: skip
    spans = [_span(100.5, 40, 5, 0.2, 0.6), _span(100.0, 30, 4, 0.1, 0.4), _span(101.0, 50, 1, 0.3, 0.3)]
    lines = [{"resourceSpans": [{"scopeSpans": [{"spans": spans[:2]}]}]},
             {"resourceSpans": [{"scopeSpans": [{"spans": spans[2:]}]}]}]  # fmt: skip
    (run / "traces.json").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return run


def write_bench(root: Path, model: str = "org/Tiny", version: str = "0.19.0",
                resolved: dict | None = None) -> Path:  # fmt: skip
    """A checkout's bench/examples/<GPU>/<model>/vllm/ and configs/model/."""
    config = root / "configs" / "model" / f"{model}.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(TINY))
    folder = root / "bench" / "examples" / "RTXPRO6000" / model.split("/")[-1]
    (folder / "vllm").mkdir(parents=True)
    (folder / "vllm" / "meta.json").write_text(json.dumps({
        "model": model, "vllm_version": version, **({"resolved_config": resolved} if resolved else {}),
        "engine_kwargs": {"tensor_parallel_size": 1, "max_num_seqs": 4, "max_num_batched_tokens": 128}}))  # fmt: skip
    rows = [{"request_id": f"bench-{i}", "input_toks": 20 + i, "output_toks": 3 + i,
             "arrival_time": 1e9 + i, "queued_ts": 50.0 + 0.25 * i, "scheduled_ts": 50.0 + 0.25 * i,
             "first_token_ts": 50.1 + 0.25 * i, "last_token_ts": 50.5 + 0.25 * i} for i in range(4)]  # fmt: skip
    (folder / "vllm" / "requests.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


def test_an_inference_sim_run_is_its_spans_in_arrival_order(tmp_path):
    run = read_inference_sim(write_inference_sim(tmp_path), tmp_path / "model_configs")
    assert run.model == "org/Tiny-Llama" and run.model_config.parent.name == "tiny-llama"
    assert run.arrival.tolist() == [0.0, 0.5, 1.0] and run.prompt.tolist() == [30, 40, 50]
    assert run.ttft.tolist() == [0.1, 0.2, 0.3] and run.output.tolist() == [4, 5, 1]
    assert run.tpot[:2] == pytest.approx([0.1, 0.1]) and np.isnan(run.tpot[2])  # one token: none
    assert (run.kv_cache_tokens, run.shared_prefix, run.vllm_version) == (4096, 16, "0.11.0")
    assert run.max_model_len == 2048 and run.notes  # the engine's, not exp-config's: said so
    assert run.prefix_caching and run.max_num_batched_tokens == 64 and run.max_num_seqs == 8


def test_an_llmservingsim_bench_run_is_measured_from_queueing(tmp_path):
    run = read_llmservingsim_bench(write_bench(tmp_path), tmp_path / "configs" / "model")
    assert run.gpu == "RTXPRO6000" and run.name == "RTXPRO6000/Tiny"
    assert run.arrival.tolist() == [0.0, 0.25, 0.5, 0.75]
    assert run.ttft == pytest.approx([0.1] * 4) and run.e2e == pytest.approx([0.5] * 4)
    assert run.tpot == pytest.approx([0.4 / 2, 0.4 / 3, 0.4 / 4, 0.4 / 5])
    assert run.max_num_batched_tokens == 128 and run.kv_cache_tokens is None


@pytest.mark.parametrize(
    "version, resolved, expected, said",
    [
        ("0.19.0", None, True, True),  # not recorded: 0.19's default, said in the notes
        ("0.11.2", None, False, True),
        ("0.11.2", {"scheduler_config": {"async_scheduling": True}}, True, False),
        ("0.19.0", {"scheduler_config": {"async_scheduling": False}}, False, False),
    ],
)
def test_a_bench_run_says_whether_vllm_scheduled_asynchronously(tmp_path, version, resolved,
                                                                  expected, said):  # fmt: skip
    folder = write_bench(tmp_path, version=version, resolved=resolved)
    run = read_llmservingsim_bench(folder, tmp_path / "configs" / "model")
    assert run.async_scheduling is expected
    assert any("async scheduling" in n for n in run.notes) is said
    assert replay_config(run, tmp_path / "replay")["executor"] == {"name": "simulated",
                                                                  "overlap": expected}  # fmt: skip


def test_an_inference_sim_run_schedules_asynchronously_only_when_its_log_asked(tmp_path):
    root = write_inference_sim(tmp_path)
    assert not read_inference_sim(root, tmp_path / "model_configs").async_scheduling
    log = root / "vllm.log"
    log.write_text(log.read_text() + "INFO non-default args: {'async_scheduling': True}\n")
    assert read_inference_sim(root, tmp_path / "model_configs").async_scheduling


def test_find_runs_reads_both_formats_and_says_what_cannot_be_replayed(tmp_path):
    write_inference_sim(tmp_path)
    write_bench(tmp_path)
    moe = write_bench(tmp_path, "org/Moe")
    config = tmp_path / "configs" / "model" / "org" / "Moe.json"
    config.write_text(json.dumps({**TINY, "num_experts": 8}))
    runs = {r.name: r for r in find_runs(tmp_path)}
    assert set(runs) == {"run-1", "RTXPRO6000/Tiny", "RTXPRO6000/Moe"} and moe.is_dir()
    assert "mixture-of-experts" in unsupported(runs["RTXPRO6000/Moe"])
    assert unsupported(runs["run-1"]) is None
    runs["run-1"].gpu = "B200"
    assert "no profile" in unsupported(runs["run-1"])


def test_a_replay_serves_the_runs_requests_with_its_settings(tmp_path):
    run = read_inference_sim(write_inference_sim(tmp_path / "src"), tmp_path / "src" / "model_configs")
    config = replay_config(run, tmp_path / "replay")
    assert config["hardware"] == "h100-sxm" and config["scheduler"]["chunk_size"] == 64
    assert config["allocator"] == {"name": "paged", "block_size": 16, "prefix_caching": True}
    # the log's KV capacity: 4,096 tokens of 2 layers x 2 KV heads x d 16 x K and V x 2 bytes
    assert config["engine"]["kv_cache_memory"] == 4096 * 2 * 2 * 16 * 2 * 2
    lines = [json.loads(line) for line in (tmp_path / "replay" / "trace.jsonl").read_text().splitlines()]
    assert [len(line["prompt_token_ids"]) for line in lines] == [30, 40, 50]
    assert lines[0]["prompt_token_ids"][:16] == lines[2]["prompt_token_ids"][:16]  # the shared prefix
    assert lines[0]["prompt_token_ids"][16:20] != lines[1]["prompt_token_ids"][16:20]
    result = replay(run, tmp_path / "again")
    assert np.all(np.isfinite(result.ttft)) and np.all(result.e2e >= result.ttft)
    assert set(result.mean_errors()) == {"ttft", "tpot", "e2e"}
