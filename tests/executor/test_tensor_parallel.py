"""Tensor parallelism 2 on the CPU (gloo, float64): exactly transformers' tokens
and the single-process logits, over the oracle's combinations; failures reported
with the rank and cause; no worker left behind.

Cost: starting a worker group costs seconds (a fresh interpreter imports torch),
an engine on a running group milliseconds. So the whole module shares one
group: `servelab.executor.parallel.group.acquire` hands the running group to each
new engine of the same size, whose workers then load its checkpoint. The
scheduler, allocator and preemption policy live on rank 0 only, so one group
serves every combination. The tests that break a group (a killed worker) are
in test_tensor_parallel_failures.py.
"""

from __future__ import annotations

import pytest
import torch

from servelab import LLM, SamplingParams, hookimpl
from servelab.errors import ConfigError
from servelab.executor.parallel import current_group
from servelab.registry.plugin_manager import get_plugin_manager
from servelab.testing.hf_reference import build_tiny_hf
from servelab.testing.oracle import (
    ENGINE_OPTIONS,
    assert_matches_reference,
    combinations,
    combo_id,
    drive,
    make_case,
)
from tests.executor.decode_scenes import skip_unless_triton_interpreted
from tests.executor.tp_helpers import no_stray_workers, one_group_then_none  # noqa: F401

TP = dict(tensor_parallel_size=2)
# the oracle's enumeration: every scheduler x allocator x preemption variant under
# one backend, and every backend variant under one scheduler, allocator and policy
ONE_BACKEND = "per_request"
SAP = [c for c in combinations() if c["attention"]["name"] == ONE_BACKEND]
ONE_SAP = {
    "scheduler": {"name": "chunked", "admission": "on_demand", "chunk_size": 8},
    "allocator": {"name": "paged", "block_size": 4},
    "preemption": {"name": "swap"},
}
BACKENDS = [c for c in combinations() if all(c[k] == v for k, v in ONE_SAP.items())]


class LogitsSpy:
    """A runtime plugin that records every step's logits of the latest engine
    (the whole vocabulary's: under tensor parallelism, after rank 0 gathered them)."""

    def __init__(self) -> None:
        self.engine = None
        self.logits: list[torch.Tensor] = []

    @hookimpl
    def servelab_engine_ready(self, engine) -> None:
        self.engine, self.logits = engine, []
        runner = engine.executor.runner
        logits = runner.logits

        def recorded(hidden):
            out = logits(hidden)
            self.logits.append(out.clone())
            return out

        runner.logits = recorded


@pytest.fixture(scope="module")
def spy():
    manager = get_plugin_manager()
    watcher = LogitsSpy()
    manager.register(watcher, name="test-tp-logits-spy")
    yield watcher
    manager.unregister(watcher)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    made = {}

    def get(arch: str, num_kv_heads: int = 2):
        key = (arch, num_kv_heads)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{arch}-kv{num_kv_heads}")
            made[key] = make_case(arch, folder, num_kv_heads=num_kv_heads)
        return made[key]

    return get


def check_tokens(case, combo, **engine):
    run = drive(case, combo, **TP, **engine)
    assert_matches_reference(case, combo, run)
    on_demand = combo["scheduler"].get("admission", "on_demand") == "on_demand"
    allocator = combo["allocator"]
    if on_demand and (allocator["name"] == "paged" or allocator.get("page_size", 1) > 1):
        # as in the oracle: the budget preempts, so swap / recompute ran on every rank
        assert run.preempted > 0, f"[{combo_id(combo)}] nothing was preempted"
    return run


# -- tokens: Qwen3 with its 2 KV heads split, one per rank
@pytest.mark.parametrize("combo", SAP, ids=combo_id)
def test_every_scheduler_allocator_preemption(cases, combo, spy):
    check_tokens(cases("qwen3"), combo)
    assert spy.engine.executor.group is current_group()


@pytest.mark.parametrize("combo", BACKENDS, ids=combo_id)
def test_every_attention_backend(cases, combo, spy):
    if combo["attention"]["name"] == "triton_paged":
        skip_unless_triton_interpreted()  # the ranks run it on CPU tensors
    check_tokens(cases("qwen3"), combo)


# Qwen2 (q/k/v biases) and Llama (tied embeddings) differ inside the model only;
# one KV head on 2 ranks is replicated (each rank holds it for its query heads)
@pytest.mark.parametrize(
    "arch, num_kv_heads", [("qwen2", 2), ("llama", 2), ("qwen3", 1), ("llama", 1)]
)
@pytest.mark.parametrize("combo", [BACKENDS[0], SAP[0]], ids=combo_id)
def test_architectures_and_kv_replication(cases, arch, num_kv_heads, combo):
    check_tokens(cases(arch, num_kv_heads), combo)


@pytest.mark.parametrize("cpu_kernels", ["on", "off"])
def test_cpu_kernels_and_torch_path(cases, cpu_kernels, spy):
    """The C++ kernels' forward (all-reduce between its matmuls) and torch's own."""
    combo = {**ONE_SAP, "attention": {"name": ONE_BACKEND}}
    check_tokens(cases("qwen3"), combo, cpu_kernels=cpu_kernels)
    assert spy.engine.executor.runner.cpu_kernels == (cpu_kernels == "on")


# -- logits: within 1e-9 of the single-process run (same decisions, same steps)
@pytest.mark.parametrize("num_kv_heads", [2, 1])
@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_logits_match_single_process(cases, spy, num_kv_heads, cpu_kernels):
    case = cases("qwen3", num_kv_heads)
    combo = {**ONE_SAP, "attention": {"name": ONE_BACKEND}}
    # a replicated KV head takes memory on both ranks: the single process gets half
    # the budget, so both hold as many tokens and every decision (preemption included)
    # is the same
    scale = 2 if num_kv_heads < TP["tensor_parallel_size"] else 1
    budget = {k: ENGINE_OPTIONS[k] // scale for k in ("kv_cache_memory", "swap_space")}
    single = drive(case, combo, cpu_kernels=cpu_kernels, **budget)
    single_logits = spy.logits
    split = drive(case, combo, cpu_kernels=cpu_kernels, **TP)
    assert split.num_steps == single.num_steps and split.preempted == single.preempted > 0
    assert split.tokens == single.tokens == case.expected
    assert len(spy.logits) == len(single_logits) > 0
    for step, (a, b) in enumerate(zip(single_logits, spy.logits)):
        assert a.shape == b.shape, f"step {step}"
        assert a.dtype == torch.float64
        assert (a - b).abs().max().item() <= 1e-9, f"step {step}"


# -- configuration errors come before any worker starts
def test_shapes_that_cannot_be_split(cases):
    with pytest.raises(ConfigError, match="its 4 attention heads"):
        LLM(model=str(cases("qwen3").folder), tensor_parallel_size=3, dtype="float64")


def test_cuda_graphs_on_the_cpu_leave_every_rank_eager():
    """Where graphs cannot run, rank 0 asks no worker to capture: every rank runs
    eagerly (test_tensor_parallel_graphs.py replays them, with a stand-in)."""
    options = dict(model="tiny", dtype="float64", num_threads=1)
    llm = LLM(**options, cuda_graphs=True, **TP)
    status = llm.engine.executor.runner.graphs_status
    assert status.startswith("eager:") and "CUDA device" in status, status
    params = SamplingParams(max_tokens=5)
    tokens = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    assert tokens == LLM(**options).generate([[5, 6, 7]], params)[0].outputs[0].token_ids


def test_the_collectives_backend_is_checked_before_any_worker_starts():
    with pytest.raises(ConfigError, match="distributed_backend must be one of auto, nccl, gloo"):
        LLM(model="tiny", tensor_parallel_size=2, distributed_backend="mpi")
    with pytest.raises(ConfigError, match="distributed_backend=nccl needs CUDA devices"):
        LLM(model="tiny", tensor_parallel_size=2, distributed_backend="nccl")


def test_gloo_named_explicitly_is_the_cpu_default_and_keeps_the_group():
    before = current_group()
    llm = LLM(model="tiny", dtype="float64", num_threads=1, distributed_backend="gloo", **TP)
    assert llm.engine.executor.group.backend == "gloo"
    assert before is None or current_group() is before  # the same workers, not a new start
    params = SamplingParams(max_tokens=4)
    tokens = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    alone = LLM(model="tiny", dtype="float64", num_threads=1).generate([[5, 6, 7]], params)
    assert tokens == alone[0].outputs[0].token_ids


def test_a_vocabulary_the_ranks_do_not_divide(tmp_path, spy):
    """127 tokens over 2 ranks: 64 rows each, the last one zero-padded; the padding's
    logits are cut off by rank 0, so the logits and tokens are the single process's."""
    build_tiny_hf("qwen3", vocab_size=127, tied=True).save_pretrained(tmp_path)
    prompts = [[5, 6, 7], [126, 64, 63, 1, 0]]  # ids on both ranks, at the edges of the split
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    runs = {}
    for tp in (1, 2):
        llm = LLM(model=str(tmp_path), dtype="float64", num_threads=1, max_model_len=64,
                  tensor_parallel_size=tp)  # fmt: skip
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runs[tp] = tokens, spy.logits
    assert runs[2][0] == runs[1][0]
    for a, b in zip(runs[1][1], runs[2][1], strict=True):
        assert a.shape == b.shape and a.shape[-1] == 127
        assert (a - b).abs().max().item() <= 1e-9


def test_structured_outputs_under_tensor_parallelism():
    """Rank 0 samples: a constrained request's mask is applied to the gathered
    logits, and the tokens are the single process's."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 999}, "k": {"enum": ["a", "b"]}}, "required": ["n", "k"]}  # fmt: skip
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c)
              for c in ({"json": schema}, {"regex": "[a-z]{2}[0-9]"}, {"choice": ["x", "yz"]})]
    prompts = [[5, 6, 7], [9, 10], [11]]
    tp = LLM(model="tiny", dtype="float64", num_threads=1, **TP).generate(prompts, params)
    alone = LLM(model="tiny", dtype="float64", num_threads=1).generate(prompts, params)
    assert [o.token_ids for o in tp] == [o.token_ids for o in alone]
    assert all(o.finish_reason == "stop" for o in tp)


@pytest.mark.parametrize("proposer", ["reference", "ngram"])
def test_speculative_decoding_verifies_on_every_rank(cases, proposer):
    """Rows of 1 + drafts tokens reach every rank; the rejected drafts' K/V are rolled
    back on each (n-gram's run also preempts; the reference drafts' shorter run does
    not): TP 2's tokens are the reference's."""
    from servelab.testing.conformance import temporarily_registered
    from servelab.testing.proposers import ReferenceProposer

    case = cases("qwen3")
    combo = next(c for c in SAP if c["allocator"]["name"] == "paged"
                 and c["scheduler"].get("admission", "on_demand") == "on_demand")  # fmt: skip
    nodes = {
        "reference": {"k": 4, "prompts": case.prompts, "outputs": case.expected, "wrong": 0.2},
        "ngram": {"name": "ngram", "k": 3, "min_n": 1, "max_n": 2},
    }
    with temporarily_registered("proposer", ReferenceProposer) as name:
        node = {"name": name, **nodes["reference"]} if proposer == "reference" else nodes[proposer]
        run = drive(case, {**combo, "proposer": node}, **TP)
    assert_matches_reference(case, {**combo, "proposer": {"name": proposer}}, run)
    assert run.scheduler_stats["spec_num_drafts"] > 0
    if proposer == "reference":
        assert run.scheduler_stats["spec_num_accepted_tokens"] > 0
    else:
        assert run.preempted > 0
