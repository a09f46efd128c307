"""servelab side by side with Hugging Face transformers, in one process, on the
same weights and the same requests: the reference workload.

- The `bench` model's seed-0 random weights are copied into transformers'
  `Qwen3ForCausalLM` and saved once with `save_pretrained`; both engines load
  that folder.
- transformers: `generate` on left-padded static batches of 64 (greedy,
  `attention_mask`, `max_new_tokens` = the longest output of the batch, no
  EOS); request i counts only its own `max_tokens` outputs.
- servelab: its best configuration on the reference machine (`BEST`).
- Both: 2 threads, float32, warm-up outside the clock.

Reported (`extra_info`, and printed with `-s`): both output tok/s, their ratio
and the token match rate. float32 greedy can flip a near-tie between two
correct implementations (different summation orders); the float64 check at
the end must match exactly on a subset (see benchmarks/README.md).

    pytest benchmarks/test_vs_transformers.py -s
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from reference_workload import NUM_THREADS, SMOKE, prepared_engine, reference_config, serve_all

from servelab.lab.workload import WorkloadRequest
from servelab.model.config import named_config
from servelab.model.loader import load_model

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

# servelab's fastest configuration on the reference machine (see the end-to-end group)
BEST = dict(
    scheduler={"name": "continuous"},
    allocator={"name": "paged", "block_size": 16},
    attention={"name": "flash_varlen", "impl": "cpu"},
)
HF_BATCH = 64
ROUNDS = int(os.environ.get("SERVELAB_VS_HF_ROUNDS", "1"))  # alternating runs; best of each
FLOAT64_SUBSET = 8  # requests of the exact float64 check
FLOAT64_MAX_TOKENS = 4 if SMOKE else 24


def hf_config(dtype: torch.dtype):
    """transformers' Qwen3 config of servelab's `bench` shape."""
    c = named_config("bench")
    config = transformers.Qwen3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings,
        eos_token_id=c.eos_token_ids[0],
        pad_token_id=0,
        bos_token_id=None,
        dtype=dtype,
    )
    config._attn_implementation = "sdpa"
    return config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """servelab's seed-0 `bench` weights, saved once by transformers."""
    folder = tmp_path_factory.mktemp("bench-hf")
    seed = reference_config()["engine"]["seed"]
    servelab_model, _, _ = load_model("bench", torch.float32, "cpu", seed=seed)
    hf = transformers.Qwen3ForCausalLM(hf_config(torch.float32))
    hf.load_state_dict(servelab_model.state_dict(), strict=True)  # the same names
    hf.save_pretrained(folder)
    return folder


def hf_model(folder: Path, dtype: torch.dtype):
    model = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=dtype)
    model.config._attn_implementation = "sdpa"
    # ignore_eos: `generate` falls back to the model's own generation config for an
    # unset eos_token_id, and would then pad a request after it samples EOS
    model.generation_config.eos_token_id = None
    return model.eval()


@dataclass
class Run:
    wall_s: float
    output_tokens: int
    outputs: list[list[int]]  # per request, in workload order

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


@torch.inference_mode()
def hf_generate(model, requests: list[WorkloadRequest]) -> Run:
    """Static batches of HF_BATCH requests, left-padded, greedy, no EOS."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(requests), HF_BATCH):
        batch = requests[first : first + HF_BATCH]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        new_tokens = max(r.params.max_tokens for r in batch)
        config = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0
        )
        out = model.generate(ids, attention_mask=mask, generation_config=config)
        assert out.shape[1] == width + new_tokens, "generate stopped early"
        for i, r in enumerate(batch):
            outputs.append(out[i, width : width + r.params.max_tokens].tolist())
    wall = time.perf_counter() - start
    return Run(wall, sum(len(o) for o in outputs), outputs)


def servelab_config(folder: Path, dtype: str = "float32") -> dict:
    return reference_config(
        model={"name": "bench", "path": str(folder)}, engine={"dtype": dtype}, **BEST
    )


def servelab_generate(folder: Path, dtype: str, requests: list[WorkloadRequest]) -> Run:
    engine, _ = prepared_engine(servelab_config(folder, dtype))
    return as_run(serve_all(engine, requests), requests)


def as_run(result, requests: list[WorkloadRequest]) -> Run:
    return Run(
        result.wall_s, result.output_tokens, [result.outputs[r.request_id] for r in requests]
    )


def reference_requests() -> list[WorkloadRequest]:
    from reference_workload import reference_requests as make

    config = reference_config()
    return make(named_config("bench").vocab_size, config["engine"]["max_model_len"])


def test_servelab_vs_transformers(benchmark, checkpoint):
    """The timed rows are servelab's runs; before each, transformers runs the
    same requests (alternating, so a noisy neighbour hits both sides alike)."""
    torch.set_num_threads(NUM_THREADS)
    requests = reference_requests()
    hf = hf_model(checkpoint, torch.float32)
    hf_generate(hf, requests[:2])  # warm-up: first-call costs stay out of the clock
    hf_runs: list[Run] = []
    servelab_runs: list[Run] = []

    def setup():
        hf_runs.append(hf_generate(hf, requests))
        engine, _ = prepared_engine(servelab_config(checkpoint))  # built and warmed up
        return (engine,), {}

    def run(engine):
        servelab_runs.append(as_run(serve_all(engine, requests), requests))

    benchmark.group = "servelab vs transformers: reference workload"
    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1)
    hf_best = min(hf_runs, key=lambda r: r.wall_s)
    ours = min(servelab_runs, key=lambda r: r.wall_s)
    assert hf_best.output_tokens == ours.output_tokens == sum(r.params.max_tokens for r in requests)

    same_requests = sum(a == b for a, b in zip(ours.outputs, hf_best.outputs))
    same_tokens = sum(x == y for a, b in zip(ours.outputs, hf_best.outputs) for x, y in zip(a, b))
    ratio = ours.tok_s / hf_best.tok_s
    benchmark.extra_info.update(
        transformers_tok_s=round(hf_best.tok_s, 1),
        servelab_tok_s=round(ours.tok_s, 1),
        ratio=round(ratio, 2),
        transformers_wall_s=[round(r.wall_s, 2) for r in hf_runs],
        servelab_wall_s=[round(r.wall_s, 2) for r in servelab_runs],
        request_match_rate=round(same_requests / len(requests), 4),
        token_match_rate=round(same_tokens / ours.output_tokens, 4),
        threads=torch.get_num_threads(),
    )
    print(
        f"\ntransformers {hf_best.tok_s:.1f} tok/s, servelab {ours.tok_s:.1f} tok/s, "
        f"ratio {ratio:.2f}x; identical outputs: {same_requests}/{len(requests)} requests, "
        f"{same_tokens}/{ours.output_tokens} tokens"
    )
    # float32 near-ties may flip; a flip shows as a divergence, never as garbage
    assert same_tokens / ours.output_tokens > 0.9


def test_float64_outputs_identical(checkpoint):
    """In float64 both implementations agree exactly: transformers' RMSNorm and
    RoPE (float32 inside even for a float64 model) are patched to float64 as
    the oracle does, then servelab's best configuration must produce its tokens."""
    from servelab.testing.hf_reference import make_hf_exact_float64, reference_inv_freq

    torch.set_num_threads(NUM_THREADS)
    c = named_config("bench")
    requests = [
        WorkloadRequest(r.prompt_token_ids, _capped(r.params), request_id=r.request_id)
        for r in reference_requests()[:FLOAT64_SUBSET]
    ]
    hf = hf_model(checkpoint, torch.float64)
    make_hf_exact_float64(hf, reference_inv_freq(c.head_dim, c.rope_theta, None))
    expected = hf_generate(hf, requests).outputs
    assert servelab_generate(checkpoint, "float64", requests).outputs == expected


def _capped(params):
    from dataclasses import replace

    return replace(params, max_tokens=min(params.max_tokens, FLOAT64_MAX_TOKENS))
