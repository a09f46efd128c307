"""`engine.compile=true` with `engine.cuda_graphs=true`: the decode graph runner
wraps the compiled forward. On a CPU the graphs are stood in for by
`ForwardReplay` (capture records the call, replay reruns it into the output
buffer), so bucket choice, padding rows, the one-compile-before-capture rule
and the compiled forward run together; the tokens are transformers' float64
greedy tokens and the eager engine's. On CUDA the real graphs capture the
compiled forward and the tokens equal the eager engine's."""

from __future__ import annotations

import random

import pytest
import torch
import torch._dynamo

import servelab.executor.model_runner
from servelab import LLM, SamplingParams
from servelab.executor.cuda_graphs import PAD_SLOT, DecodeGraphRunner, graph_buckets
from servelab.executor.forward import TorchForward
from servelab.plugins.attention.triton_paged import TritonPagedBackend
from tests.executor.decode_scenes import (
    TRITON_DEVICE,
    CpuReplayRunner,
    assert_same_decode,
    make_scene,
    skip_unless_triton_interpreted,
)
from tests.executor.test_device_path import forward_steps, oracle_llm, oracle_tokens


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing: a cache left by another test would hide
    where (warm-up or capture) the compiles happen."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def count_compiles_in_capture(monkeypatch, runner_class) -> list[int]:
    """Patches `runner_class._capture_graph` to record, per captured bucket, how
    many graphs dynamo compiled inside the capture; returns that list."""
    during: list[int] = []
    capture = runner_class._capture_graph

    def counted(self, input_ids, positions, plan):
        before = compiled_graphs()
        result = capture(self, input_ids, positions, plan)
        during.append(compiled_graphs() - before)
        return result

    monkeypatch.setattr(runner_class, "_capture_graph", counted)
    return during


def test_replays_of_the_compiled_forward_match_eager_and_pad_safely(monkeypatch):
    """Two decode steps (5 then 3 sequences) through graphs of the compiled forward:
    buckets 8 and 4, padding rows at PAD_SLOT write no K/V, hidden states and the
    written K/V equal the eager float64 forward's; every compile ran in a bucket's
    warm-up, none inside a capture (a real capture cannot compile)."""
    skip_unless_triton_interpreted()
    scene = make_scene(TRITON_DEVICE, torch.float64, "triton_paged")
    compiled = TorchForward(scene.model, compile=True)

    def forward(ids, positions, plan):
        return compiled.forward(ids, positions, scene.kv.layers, scene.backend, plan)

    during_capture = count_compiles_in_capture(monkeypatch, CpuReplayRunner)
    runner = CpuReplayRunner(
        forward,
        scene.backend,
        max_num_seqs=8,
        max_model_len=scene.max_model_len,
        block_size=scene.block_size,
        device=TRITON_DEVICE,
    )
    pool_before = scene.kv.device_pool.clone()
    before = compiled_graphs()
    runner.capture()
    assert compiled_graphs() > before  # the warm-ups compiled: the counter sees compiles
    assert during_capture == [0, 0, 0, 0]
    assert runner.captured == [8, 4, 2, 1]  # largest first: the others reuse its pool
    assert torch.equal(scene.kv.device_pool, pool_before), "capture wrote K/V"

    assert [runner.bucket_for(meta) for _, meta in scene.steps] == [8, 4]
    assert_same_decode(scene, runner.run, tol=1e-12)  # also: no padding row wrote K/V
    assert runner.num_replays == 2 and runner.num_eager == 0
    assert runner.graphs[8].num_replays == 1 and runner.graphs[4].num_replays == 1
    # the second step's 4th row padded the bucket: its slot was a real row's in step one
    assert runner.static.slot_mapping[3] == PAD_SLOT
    assert scene.steps[0][1].slot_mapping[3] >= 0


def test_engine_with_compile_and_graphs_gives_the_reference_tokens(monkeypatch):
    """The engine (oracle checkpoint, float64, graph-safe `triton_paged`
    interpreted, graphs stood in for): decode steps replay graphs of the compiled
    forward, other steps run it eagerly, attention is never traced, no step
    compiles anything, and the tokens are transformers' greedy tokens and those
    of the engine without compile and graphs."""
    skip_unless_triton_interpreted()  # the CUDA twin: test_compile_and_graphs_on_cuda_...
    monkeypatch.setattr(servelab.executor.model_runner, "DecodeGraphRunner", CpuReplayRunner)
    during_capture = count_compiles_in_capture(monkeypatch, CpuReplayRunner)
    # spied on the class: the compiled forward wraps the backend's method when it is built
    traced = []
    attend = TritonPagedBackend.forward

    def spy(self, *args):
        traced.append(torch.compiler.is_compiling())
        return attend(self, *args)

    monkeypatch.setattr(TritonPagedBackend, "forward", spy)
    case, llm = oracle_llm("triton_paged", compile=True, cuda_graphs=True)
    runner = llm.engine.executor.runner
    assert isinstance(runner.model_forward, TorchForward) and runner.model_forward.compiled
    assert runner.graphs_status.startswith("captured"), runner.graphs_status
    assert sorted(runner.graphs.graphs) == list(graph_buckets(8))
    assert during_capture == [0] * len(graph_buckets(8))
    assert traced and not any(traced)  # the warm-ups and captures ran attention eagerly
    del traced[:]
    count = 6
    compiled_before = compiled_graphs()
    got = oracle_tokens(llm, case, count)
    assert compiled_graphs() == compiled_before  # every shape was compiled at capture
    assert traced and not any(traced)
    ran, single = forward_steps(llm)
    assert single > 0 and ran > single
    assert runner.graphs.num_replays == single and runner.graphs.num_eager == ran - single

    assert got == case.expected[:count]  # transformers, float64
    _, eager = oracle_llm("triton_paged")
    assert eager.engine.executor.runner.graphs is None
    assert not getattr(eager.engine.executor.runner.model_forward, "compiled", None)
    assert got == oracle_tokens(eager, case, count)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: real torch.cuda.CUDAGraph capture of the compiled forward "
    "(the CPU tests above stand in for the graphs)",
)
def test_compile_and_graphs_on_cuda_equal_eager(monkeypatch):
    """Real CUDA graphs over the compiled forward (float32, the tiny model): every
    bucket captured without compiling inside a capture, decode steps replayed, and
    the greedy tokens equal the engine's with compile and graphs off."""
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    options = dict(
        model="tiny",
        attention="triton_paged",
        device="cuda",
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
    )
    during_capture = count_compiles_in_capture(monkeypatch, DecodeGraphRunner)
    llm = LLM(**options, compile=True, cuda_graphs=True)
    runner = llm.engine.executor.runner
    assert isinstance(runner.model_forward, TorchForward) and runner.model_forward.compiled
    assert runner.graphs_status.startswith("captured"), runner.graphs_status
    assert during_capture == [0] * len(graph_buckets(8))
    got = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert runner.graphs.num_replays > 0
    eager = LLM(**options)
    assert got == [out.outputs[0].token_ids for out in eager.generate(prompts, params)]
