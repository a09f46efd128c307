"""`benchmarks/cpu_real_size.py` without vLLM and without timing anything: each
`--shape` brings its own workload (the counts and ranges below are the
benchmark's published ones), the FLOP and weight-byte counts match the weights
transformers builds for the shape, and the tiny shape's checkpoint loads into
servelab as the embedded tiny model with head_dim 32 and serves its requests."""

from __future__ import annotations

import dataclasses
import json
from argparse import Namespace

import pytest
import torch

from servelab.model.config import ModelConfig, named_config
from tests.benchmark_scripts import load_benchmark

# shape -> (requests, prompt tokens, output tokens), inclusive ranges
WORKLOADS = {
    "qwen3-0.6b": (32, (64, 512), (32, 128)),
    "tiny": (64, (32, 256), (16, 256)),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("cpu_real_size")


def test_every_shape_is_offered_and_a_bad_one_names_the_choices(bench, capsys):
    assert set(bench.SHAPES) == set(WORKLOADS)
    assert bench.parse_args([]).shape == "qwen3-0.6b"
    with pytest.raises(SystemExit):
        bench.parse_args(["--shape", "huge"])
    assert "qwen3-0.6b" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_each_shape_brings_its_own_workload(bench, tmp_path, name):
    count, (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
    requests = bench.write_workload(tmp_path / "w.json", bench.SHAPES[name])
    assert json.loads((tmp_path / "w.json").read_text()) == requests
    assert len(requests) == count
    vocab = named_config(name).vocab_size
    assert all(0 <= t < vocab for r in requests for t in r["prompt"])
    assert all(p_lo <= len(r["prompt"]) <= p_hi for r in requests)
    assert all(o_lo <= r["max_tokens"] <= o_hi for r in requests)
    # 64 draws spread over the range, not one corner of it
    assert max(len(r["prompt"]) for r in requests) > (p_lo + p_hi) / 2
    assert len(bench.write_workload(tmp_path / "w.json", bench.SHAPES[name], 3)) == 3


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_matmul_params_count_the_projection_weights_transformers_builds(bench, name):
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(bench.hf_config(bench.SHAPES[name]))
    counted = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-2] in PROJECTIONS)
    assert bench.matmul_params(bench.SHAPES[name]) == counted


def test_the_tiny_checkpoint_is_the_embedded_tiny_model_with_head_dim_32(bench, tmp_path):
    bench.write_checkpoint(tmp_path, bench.SHAPES["tiny"])
    loaded = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    tiny = named_config("tiny")
    assert tiny.head_dim == 16 and loaded.head_dim == 32
    differing = [
        f.name
        for f in dataclasses.fields(tiny)
        if getattr(loaded, f.name) != getattr(tiny, f.name)
        and f.name not in ("eos_token_ids", "bos_token_id")  # ignore_eos: unused here
    ]
    assert differing == ["head_dim"]


def test_servelab_serves_the_tiny_shape(bench, tmp_path):
    shape = bench.SHAPES["tiny"]
    bench.write_checkpoint(tmp_path / "ckpt", shape)
    requests = bench.write_workload(tmp_path / "w.json", shape, 3)
    args = Namespace(
        shape="tiny", workload=tmp_path / "w.json", checkpoint=tmp_path / "ckpt",
        dtype="float32", threads=1, attention_impl="auto", cpu_kernels="auto",
        kv_cache="16MiB",
    )  # fmt: skip
    run = bench.servelab_worker(args)
    assert [len(t) for t in run["tokens"]] == [r["max_tokens"] for r in requests]
    assert run["prefill_flop"] == 2 * bench.matmul_params(shape) * sum(
        len(r["prompt"]) for r in requests
    )
    # each decode step reads the K/V its cache holds: 2 (K and V) x layers x KV heads x head_dim
    c = shape.config()
    kv_token_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert run["decode_kv_bytes"] > 0 and run["decode_kv_bytes"] % kv_token_bytes == 0


def runs(system: str, rates: list[float], rounds: list[int]) -> list[dict]:
    return [
        {"system": system, "output_tokens": rate, "wall_s": 1.0, "round": k}
        for rate, k in zip(rates, rounds, strict=True)
    ]


def test_the_ratio_comes_with_an_interval_only_from_two_runs_a_side(bench):
    # one run each: the ratio of the two rates, no interval
    assert bench.compare(runs("s", [6.0], [0]), runs("v", [3.0], [0])) == "2.00x"
    # one ABBA round: two runs a side, compared unpaired (the runs' geometric means)
    text = bench.compare(runs("s", [6.0, 8.0], [0, 0]), runs("v", [3.0, 4.0], [0, 0]))
    assert text.startswith("2.00x; estimate 2.00x, 95% interval ") and "(2 and 2 runs)" in text
    # two rounds: paired by round, each round's runs averaged: ratios 2 and 2 exactly
    text = bench.compare(
        runs("s", [6.0, 6.0, 8.0, 8.0], [0, 0, 1, 1]), runs("v", [3.0, 3.0, 4.0, 4.0], [0, 0, 1, 1])
    )
    assert "estimate 2.00x, 95% interval 2.00-2.00x (2 rounds, paired)" in text


def test_agreement_counts_identical_requests_and_where_the_others_differ(bench):
    assert bench.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == "2/2 identical"
    text = bench.agreement([[1, 2, 3], [4, 5], [6, 7, 8]], [[1, 9, 3], [4, 5], [6, 7, 0]])
    assert text == "1/3 identical; the other 2 first differ at token 1.5 on average"


def test_batch1_is_one_request_of_the_asked_lengths(bench, tmp_path):
    shape = bench.SHAPES["tiny"]
    (request,) = bench.write_batch1(tmp_path / "b.json", shape, 100, 7)
    assert json.loads((tmp_path / "b.json").read_text()) == [request]
    assert len(request["prompt"]) == 100 and request["max_tokens"] == 7
    assert all(0 <= t < shape.config().vocab_size for t in request["prompt"])
    assert bench.write_batch1(tmp_path / "c.json", shape, 100, 7) == [request]


def test_the_gguf_is_cached_beside_the_checkpoint_under_its_files_hash(bench, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"\0" * 64)
    f32 = bench.gguf_path(ckpt, "float32")
    assert f32.parent == tmp_path and f32.name.startswith("ckpt-") and f32.suffix == ".gguf"
    assert f32 == bench.gguf_path(ckpt, "float32") != bench.gguf_path(ckpt, "bfloat16")
    (ckpt / "model.safetensors").write_bytes(b"\0" * 63 + b"\1")  # another checkpoint
    assert bench.gguf_path(ckpt, "float32") != f32


def test_the_converter_defaults_to_the_sdist_beside_the_llama_venv(bench):
    args = bench.parse_args(["--llama-cpp", "/v/llama/bin/python"])
    expected = "/v/llama-src/vendor/llama.cpp/convert_hf_to_gguf.py"
    assert str(bench.gguf_converter(args)) == expected
    args = bench.parse_args(["--llama-cpp", "/v/llama/bin/python", "--gguf-converter", "/c.py"])
    assert str(bench.gguf_converter(args)) == "/c.py"


def test_batch1_decode_rate_leaves_the_prefill_out(bench):
    run = {"decode_rows": 63, "decode_s": 0.5, "prefill_s": 9.0, "decode_cpu_s": 1.0}
    assert bench.decode_rate(run) == 126.0
    assert "126.00 decode tok/s" in bench.describe_batch1("servelab", "float32", run)
