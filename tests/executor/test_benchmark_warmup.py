"""The throughput benchmark's warm-up launches every Triton kernel variant its timed
run launches (keys recorded as Triton specialises, kernels interpreted), and with
graphs captured it runs a decode batch at every bucket size. The first test runs
`triton_paged` on CPU tensors: it skips where the kernels are compiled."""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from servelab.model.config import named_config
from tests.benchmark_scripts import load_benchmark
from tests.executor.decode_scenes import skip_unless_triton_interpreted


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gpu_throughput")


def tiny_engine(bench, backend="triton_paged"):
    args = bench.parse_args(["--tiny", "--backends", backend, "--requests", "4"])
    config = named_config(args.model)
    workload = bench.make_workload(args.requests, args.min_len, args.max_len, config.vocab_size, 0)
    llm = bench.build_llm(args, backend, False, bench.workload_kv_bytes(args, config, workload))
    return args, config, workload, llm


def test_warm_up_launches_every_variant_the_timed_run_launches(bench):
    skip_unless_triton_interpreted()
    variants = sys.modules["kernel_variants"]
    args, config, workload, llm = tiny_engine(bench)
    with variants.VariantRecorder() as recorder:
        bench.warm_up(llm, args, config.vocab_size)
        warm = recorder.take()
        done, _, _ = bench.timed_run(llm, workload, max_seconds=300)
        timed = recorder.take()
    assert done == len(workload.prompts)
    kernels = {key[0] for key in timed}
    assert {"triton_kernels._store_kv_kernel", "triton_kernels._paged_attention_kernel"} <= kernels
    assert timed <= warm, f"first launched while timed: {timed - warm}"


def test_variant_keys_follow_triton_specialisation(bench):
    variants = sys.modules["kernel_variants"]
    kernel = variants.kernels()["triton_kernels._paged_attention_kernel"]
    names = variants._signature(kernel)[0]

    def key(**changed):
        return variants.variant_key("k", kernel, [], {**dict.fromkeys(names, 7), **changed})

    assert key(block_size=16) != key(block_size=7)  # specialised: divisible by 16
    assert key(block_size=1) != key(block_size=7)  # specialised: equal to 1
    assert key(num_seqs=16) == key(num_seqs=7)  # do_not_specialize
    assert key(stride_bt=32) == key(stride_bt=7)  # do_not_specialize: the table's width
    assert key(BLOCK_M=32) != key(BLOCK_M=64)  # a constexpr
    assert key(num_warps=8) != key(num_warps=4)  # a launch option


def test_warm_up_runs_a_decode_batch_at_every_graph_bucket(bench, monkeypatch):
    def batch_sizes(buckets) -> Counter:
        args, config, _, llm = tiny_engine(bench, backend="per_request")
        # the warm-up asks its own module which buckets the engine captured
        monkeypatch.setattr(sys.modules["gpu_workload"], "captured_buckets", lambda _: buckets)
        sizes = Counter()
        step = llm.engine.step
        monkeypatch.setattr(
            llm.engine, "step", lambda: sizes.update([len(llm.engine.scheduler.running)]) or step()
        )
        bench.warm_up(llm, args, config.vocab_size)
        return sizes

    eager, captured = batch_sizes(()), batch_sizes((1, 3, 8))
    # max_tokens 3: a prefill step, then two decode steps of the whole bucket
    assert all(captured[b] - eager[b] >= 2 for b in (1, 3, 8)), (eager, captured)
