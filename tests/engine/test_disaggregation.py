"""Prefill/decode disaggregation in one process: a prefill engine runs each prompt and
samples its first token, a decode engine admits the request with the prompt's K/V and
decodes the rest. Float64 on the CPU, the tokens equal transformers' greedy tokens and a
colocated run's, for every allocator and preemption policy under the continuous scheduler,
with transfers that arrive while the decode engine is full (they wait, or recompute), and
preemption on the decode side."""

from __future__ import annotations

import pytest
import torch

from servelab import LLM
from servelab.engine.handover import PrefilledRequest
from servelab.errors import ConfigError, RequestError
from servelab.step.sequence import SamplingParams
from servelab.testing.disaggregation import build_pair, run_disaggregated
from servelab.testing.oracle import cached_case, combo_id, drive, variants

CONTINUOUS = {"name": "continuous", "admission": "on_demand"}
COMBOS = [
    {"scheduler": CONTINUOUS, "allocator": a, "preemption": p, "attention": {"name": "per_request"}}
    for a in variants("allocator")
    for p in variants("preemption")
]


@pytest.fixture(scope="module")
def case():
    return cached_case("qwen3")


@pytest.mark.parametrize("transfer", ["wait", "recompute"])
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_disaggregated_tokens_equal_colocated_and_reference(case, combo, transfer):
    run = run_disaggregated(case, combo, transfer=transfer)
    assert run.tokens == case.expected  # transformers' greedy tokens
    assert run.tokens == drive(case, combo).tokens  # one engine, the same parts
    # every request whose first token did not end it went to the decode engine
    assert run.handed_over == sum(1 for out in case.expected if len(out) > 1)
    stats = run.decode_stats
    assert stats["prefilled_admitted"] + stats["prefilled_recomputed"] == run.handed_over
    if transfer == "wait":
        # the decode engine was full when transfers arrived: they waited for room
        assert run.max_waiting > 0, "no transfer ever had to wait"
        assert stats["prefilled_recomputed"] == 0
        if combo["allocator"]["name"] != "contiguous":  # contiguous reserves whole slots
            assert run.decode_preempted > 0, "nothing was preempted on the decode engine"
    else:
        assert stats["prefilled_recomputed"] > 0, "no transfer fell back to recomputing"
    if combo["allocator"].get("prefix_caching") or combo["allocator"]["name"] == "radix":
        # the shared prompt prefix was attached from the decode engine's own cache
        assert stats["prefilled_prefix_hit_tokens"] > 0


def test_chunked_scheduler_decodes_handovers_too(case):
    combo = dict(COMBOS[3], scheduler={"name": "chunked", "chunk_size": 8})
    assert run_disaggregated(case, combo).tokens == case.expected


def test_simulated_executor_hands_over_without_kv():
    options = dict(model="tiny", executor="simulated", dtype="float32", max_model_len=64)
    prefill = LLM(**options).engine
    decode = LLM(**options).engine
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prefill.add_prefill_request(list(range(3, 20)), params, request_id="a")
    while prefill.has_unfinished():
        prefill.step()
    (handover,) = prefill.take_prefilled()
    assert handover.kv is None and not handover.done
    decode.add_prefilled_request(handover)
    outputs = []
    while decode.has_unfinished():
        outputs += decode.step()
    (out,) = outputs
    assert out.outputs[0].token_ids[0] == handover.first_token
    assert len(out.outputs[0].token_ids) == 5
    assert decode.allocator.num_free_blocks == decode.allocator.num_blocks


@pytest.fixture(scope="module")
def pair(case):
    return build_pair(case, COMBOS[3])  # paged, recompute


def _handover(case, prefill, prompt=4) -> PrefilledRequest:
    request_id = prefill.add_prefill_request(case.prompts[prompt], case.params[prompt])
    while prefill.has_unfinished():
        prefill.step()
    (handover,) = [h for h in prefill.take_prefilled() if h.request_id == request_id]
    return handover


def test_a_handover_carries_the_prompts_kv(case, pair):
    prefill, _ = pair
    handover = _handover(case, prefill)
    cache = prefill.executor.kv_cache.device_pool
    assert handover.kv.shape == (2, cache.shape[1], len(case.prompts[4]), *cache.shape[4:])
    assert handover.first_token == case.expected[4][0]
    assert handover.kv.abs().sum() > 0


def test_bad_handovers_are_refused_with_the_reason(case, pair):
    prefill, decode = pair
    handover = _handover(case, prefill)
    with pytest.raises(RequestError, match="shape"):
        decode.add_prefilled_request(
            PrefilledRequest(**{**vars(handover), "kv": handover.kv[:, :, :-1]})
        )
    with pytest.raises(RequestError, match="must carry its prompt's K/V"):
        decode.add_prefilled_request(PrefilledRequest(**{**vars(handover), "kv": None}))
    with pytest.raises(RequestError, match="dtype"):
        decode.add_prefilled_request(
            PrefilledRequest(**{**vars(handover), "kv": handover.kv.to(torch.float32)})
        )
    with pytest.raises(RequestError, match="nothing to decode"):
        decode.add_prefilled_request(PrefilledRequest(**{**vars(handover), "done": True}))
    with pytest.raises(RequestError, match="unknown transfer 'later'"):
        decode.add_prefilled_request(handover, transfer="later")
    with pytest.raises(RequestError, match="n=1"):
        prefill.add_prefill_request([5, 6, 7], SamplingParams(n=2))
    assert not decode.has_unfinished() and not decode.groups


def test_a_waiting_handover_can_be_aborted(case, pair):
    prefill, decode = pair
    handover = _handover(case, prefill)
    decode.add_prefilled_request(handover)
    assert decode.has_unfinished()
    out = decode.abort(handover.request_id)
    assert out is not None and out.outputs[0].finish_reason == "abort"
    assert not decode.has_unfinished()
    assert decode.allocator.num_free_blocks == decode.allocator.num_blocks


def test_tensor_parallel_is_refused():
    class TwoRanks:
        tp = 2

    from servelab.engine import handover

    engine = type("E", (), {"executor": TwoRanks()})()
    with pytest.raises(ConfigError, match="tensor_parallel_size=1"):
        handover._check_whole_cache(engine)


def test_the_first_tokens_step_comes_first_in_the_record(case, pair):
    prefill, decode = pair
    handover = _handover(case, prefill)
    decode.add_prefilled_request(handover)
    while decode.has_unfinished():
        decode.step()
    record = decode.metrics.requests[-1]
    assert record.request_id == handover.request_id
    assert len(record.token_steps) == len(record.token_times) == len(case.expected[4])
    assert record.token_steps == sorted(record.token_steps)
    assert record.first_token_time == handover.first_token_time
