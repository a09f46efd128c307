"""Tensor parallelism 2 on CUDA (the module is skipped elsewhere): greedy tokens
equal the CPU's single-process tokens; over NCCL where the machine has two
devices, else over gloo with both ranks on one device (the code path, not
NCCL's); decode graphs captured on every rank where NCCL runs."""

from __future__ import annotations

import random

import pytest
import torch

from servelab import LLM, SamplingParams
from tests.executor.decode_scenes import cuda_only
from tests.executor.tp_helpers import no_stray_workers, one_group_then_none  # noqa: F401

pytestmark = [pytest.mark.cuda, cuda_only]

TWO_DEVICES = torch.cuda.is_available() and torch.cuda.device_count() >= 2
OPTIONS = dict(model="tiny", dtype="float32", max_model_len=128, max_num_seqs=8)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randint(3, 40))] for _ in range(6)]


def tokens(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(batch, PARAMS)]


@pytest.mark.parametrize("attention", ["per_request", "triton_paged"])
def test_two_ranks_on_cuda_give_the_cpu_tokens(attention):
    batch = prompts(7)
    backend = "nccl" if TWO_DEVICES else "gloo"
    llm = LLM(
        **OPTIONS,
        attention=attention,
        device="cuda",
        tensor_parallel_size=2,
        distributed_backend=backend,
    )
    assert llm.engine.executor.group.backend == backend
    on_cuda = tokens(llm, batch)
    assert on_cuda == tokens(LLM(**OPTIONS, attention="per_request"), batch)


@pytest.mark.skipif(not TWO_DEVICES, reason="decode graphs per rank need NCCL: two CUDA devices")
def test_decode_graphs_per_rank_over_nccl():
    batch = prompts(8)
    llm = LLM(
        **OPTIONS, attention="triton_paged", device="cuda", tensor_parallel_size=2,
        cuda_graphs=True,
    )  # fmt: skip
    runner = llm.engine.executor.runner
    assert runner.graphs_status.startswith("captured"), runner.graphs_status
    on_cuda = tokens(llm, batch)
    assert runner.graphs.num_replays > 0
    assert on_cuda == tokens(LLM(**OPTIONS, attention="per_request"), batch)
