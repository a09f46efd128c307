"""Speculative decoding on the simulated executor, by counts (never the wall clock):
the `simulated` proposer drafts the executor's stand-in tokens, right at its
configured per-position rates; a verify step is priced as a decode of 1 + drafts
query tokens (less than that many decode steps, more than one); a draft model's
forwards are added to the step's time; with any other executor it refuses."""

from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest

from servelab import LLM, SamplingParams
from servelab.errors import ConfigError
from servelab.executor.cost_model import CostModel, Shape, StepShape, step_shape
from servelab.executor.hardware import load_profile
from servelab.executor.stand_in import output_token, sequence_key
from servelab.model.config import named_config
from servelab.plugins.proposers.simulated import read_trace

NONE = np.zeros(0)
RATES = [0.8, 0.6, 0.45, 0.3]
BIG = dict(model="llama3-70b", executor="simulated", hardware="h100-sxm", dtype="bfloat16",
           gpu_memory_utilization=0.9, tensor_parallel_size=4, max_model_len=4096)  # fmt: skip


def tiny(proposer="none", **options) -> LLM:
    return LLM(model="tiny", executor="simulated", proposer=proposer, **options)


def prompts(count: int) -> list[list[int]]:
    return [[3 + i, 5, 7 + i % 5, 11] * (2 + i % 3) for i in range(count)]


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


# -- drafts: right at the configured rates
def test_acceptance_one_keeps_the_outputs_and_divides_the_decode_steps_by_k_plus_one():
    """All at once, then decodes only: 1 prefill step and T - 1 decode steps without a
    proposer; with every draft right, each step keeps k drafts and the target's own
    token. Forks (n = 3) find their sample's stand-ins too."""
    k, max_tokens = 4, 201  # 200 decoded tokens: 40 verifications of 4 drafts + 1
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * 6
    params += [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=3)]
    plain_llm = tiny()
    plain = plain_llm.generate(prompts(7), params)
    spec_llm = tiny({"name": "simulated", "k": k, "acceptance": 1.0})
    spec = spec_llm.generate(prompts(7), params)
    assert tokens(spec) == tokens(plain)  # the same stand-in tokens
    assert all(len(c.token_ids) == max_tokens for o in spec for c in o.outputs)
    plain_steps, spec_steps = (
        len(plain_llm.engine.metrics.steps),
        len(spec_llm.engine.metrics.steps),
    )
    assert plain_steps == max_tokens  # one prefill step, then one token a step
    assert (plain_steps - 1) / (spec_steps - 1) == k + 1
    stats = spec_llm.engine.scheduler.stats()
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] == 9 * 200 * k // 5
    assert stats["spec_proposer_errors"] == 0
    assert spec_llm.engine.executor.now() < plain_llm.engine.executor.now() / 3


def test_accepted_counts_by_position_follow_the_configured_rates():
    """Draft i is right with probability RATES[i] once the drafts before it were: over
    thousands of verifications, kept counts sit within 4 binomial standard deviations."""
    llm = tiny({"name": "simulated", "k": 4, "acceptance": RATES, "seed": 3}, max_num_seqs=64)
    proposer = llm.engine.scheduler.speculation.proposer
    verified = []
    proposer.on_verified = lambda seq_id, drafted, accepted: verified.append((drafted, accepted))
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    llm.generate(prompts(48), params)
    assert len(verified) > 4000
    for i, rate in enumerate(RATES):
        reached = [a for d, a in verified if d > i and a >= i]  # drafts 0..i-1 were right
        kept = sum(a > i for a in reached)
        n = len(reached)
        assert abs(kept - n * rate) <= 4 * math.sqrt(n * rate * (1 - rate)), (i, kept, n)
    # a position past the list takes its last rate; the same seed drafts the same tokens
    again = tiny({"name": "simulated", "k": 4, "acceptance": RATES, "seed": 3}, max_num_seqs=64)
    again.generate(prompts(48), params)
    assert again.engine.scheduler.stats() == llm.engine.scheduler.stats()


def test_drafts_are_the_stand_ins_or_a_wrong_token():
    llm = tiny({"name": "simulated", "k": 4, "acceptance": [1.0, 0.0]})
    proposer = llm.engine.scheduler.speculation.proposer
    assert proposer.rates == [1.0, 0.0, 0.0, 0.0]
    key = sequence_key("r", 0)
    prompt = [9, 8, 7]
    outputs = [output_token(key, p, 512, proposer.eos) for p in range(3)]
    request = SimpleNamespace(seq_id=1, request_id="r", token_ids=prompt + outputs,
                              num_prompt_tokens=3, max_drafts=4)  # fmt: skip
    drafts = proposer.draft(request)
    assert drafts[0] == output_token(key, 3, 512, proposer.eos)
    assert all(d != output_token(key, 3 + i, 512, proposer.eos) for i, d in enumerate(drafts) if i)
    # tokens that are no stand-ins of the request: no key fits, no drafts
    stranger = SimpleNamespace(seq_id=2, request_id="r", token_ids=prompt + [1, 2],
                               num_prompt_tokens=3, max_drafts=4)  # fmt: skip
    assert proposer.draft(stranger) == []


def test_acceptance_from_a_recorded_runs_trace(tmp_path):
    """steps.csv's counts (kept draft i / verifications), or a summary's percentages,
    become conditional rates: P(kept i) / P(kept i - 1)."""
    steps = tmp_path / "run" / "steps.csv"
    steps.parent.mkdir()
    steps.write_text(
        "step,spec_num_drafts,spec_accepted_pos_0,spec_accepted_pos_1,spec_accepted_pos_2\n"
        "1,10,8,6,3\n2,10,8,4,0\n"
    )
    assert read_trace(str(steps)) == pytest.approx([0.8, 0.625, 0.3])
    assert read_trace(str(steps.parent)) == pytest.approx([0.8, 0.625, 0.3])  # its folder
    results = tmp_path / "results.json"
    summary = {"spec_accepted_pct_pos0": 70.0, "spec_accepted_pct_pos1": 35.0}
    results.write_text(json.dumps({"summary": summary}))
    assert read_trace(str(results)) == pytest.approx([0.7, 0.5])
    llm = tiny({"name": "simulated", "k": 3, "acceptance_trace": str(results)})
    assert llm.engine.scheduler.speculation.proposer.rates == pytest.approx([0.7, 0.5, 0.5])
    # a run recorded with a proposer, read back: the rates it ran at
    from servelab.lab.runner import run_config, save_run

    config = {"model": "tiny", "executor": "simulated",
              "proposer": {"name": "simulated", "acceptance": RATES},
              "engine": {"max_num_seqs": 32},
              "workload": {"name": "synthetic", "num_requests": 32, "prompt_len": {"dist": "fixed", "mean": 16},
                           "output_len": {"dist": "fixed", "mean": 200}},
              "run": {"progress": False, "warmup": False}}  # fmt: skip
    out = tmp_path / "recorded"
    save_run(out, run_config(config), config, {})
    rates = read_trace(str(out))
    assert rates[0] == pytest.approx(RATES[0], abs=0.03)
    assert rates[1] == pytest.approx(RATES[1], abs=0.05)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"summary": {"steps": 3}}))
    with pytest.raises(ConfigError, match="no acceptance by position"):
        read_trace(str(empty))


def test_options_are_checked():
    with pytest.raises(ConfigError, match="acceptance must be a rate"):
        tiny({"name": "simulated", "acceptance": [0.5, 1.5]})
    with pytest.raises(ConfigError, match="acceptance must be a rate"):
        tiny({"name": "simulated", "acceptance": []})
    with pytest.raises(ConfigError, match="shares its target's tokenizer"):
        tiny({"name": "simulated", "draft_model": "llama3-8b"})  # 128,256 tokens, tiny's 512
    with pytest.raises(ConfigError, match="unknown model shape|neither a named shape"):
        tiny({"name": "simulated", "draft_model": "no-such-model"})


def test_with_the_model_executor_it_refuses_and_requests_decode_without_drafts(caplog):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = LLM(model="tiny", dtype="float64", num_threads=1).generate(prompts(2), params)
    llm = LLM(model="tiny", dtype="float64", num_threads=1, proposer={"name": "simulated"})
    with caplog.at_level(logging.ERROR):
        out = llm.generate(prompts(2), params)
    assert tokens(out) == tokens(plain)
    stats = llm.engine.scheduler.stats()
    assert stats["spec_proposer_errors"] > 0 and stats["spec_num_drafts"] == 0
    assert "executor=model samples a model's own tokens" in caplog.text


# -- pricing
def cost_models(tp: int = 4) -> tuple[CostModel, CostModel]:
    profile = load_profile("h100-sxm")
    target = CostModel(Shape.of(named_config("llama3-70b")), profile, "bfloat16", 2, tp)
    draft = CostModel(Shape.of(named_config("llama3-8b")), profile, "bfloat16", 2, tp)
    return target, draft


def decode_step(batch: int, context: int) -> StepShape:
    return StepShape(NONE, NONE, np.full(batch, context + 1.0), batch)


def verify_step(batch: int, context: int, drafts: int) -> StepShape:
    """Each row computes its last token (at position `context`) and its drafts."""
    q = np.full(batch, drafts + 1.0)
    return StepShape(NONE, NONE, context + q, batch * (drafts + 1), decode_q=q)


def test_a_plan_row_with_drafts_is_a_decode_of_several_queries():
    plan = SimpleNamespace(
        counts=np.array([1, 5, 3, 64]), starts=np.array([40, 99, 7, 0]), num_decodes=1,
        draft_counts=np.array([0, 4, 2, 0]), samples=np.array([True, True, True, True]),
    )  # fmt: skip
    shape = step_shape(plan)
    assert shape.prefill_q.tolist() == [64] and shape.prefill_start.tolist() == [0]
    assert shape.decode_keys.tolist() == [41, 104, 10]  # each row's context and its drafts
    assert shape.decode_q.tolist() == [1, 5, 3]
    assert shape.sampling == 4 + 4 + 2  # logits at every draft position
    assert shape.num_tokens == 1 + 5 + 3 + 64


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_a_verify_step_costs_more_than_one_decode_step_and_less_than_k_plus_one(batch):
    """Llama-3-70B on four H100s: k + 1 query tokens a row read the weights once, as a
    decode does; at batch 1 a verify step costs within 15% of a decode step."""
    target, _ = cost_models()
    k, context = 4, 1000
    decode = target.step_time(decode_step(batch, context))
    verify = target.step_time(verify_step(batch, context, k))
    assert decode < verify < (k + 1) * decode
    if batch == 1:
        assert verify < 1.15 * decode
    # its attention op is one decode call whose blocks read each row's keys once
    ops = {op.name: op for op in target.layer_ops(verify_step(batch, context, k))}
    assert "attention_prefill" not in ops
    one = {op.name: op for op in target.layer_ops(decode_step(batch, context + k))}
    assert ops["attention_decode"].streamed == one["attention_decode"].streamed
    assert ops["attention_decode"].blocks == one["attention_decode"].blocks


def test_the_step_time_includes_the_draft_models_k_forwards():
    """One request decoding alone, every draft right: each verify step costs the
    target's decode of 5 query tokens plus four Llama-3-8B decode forwards (its
    context, then one draft more each), without their host work."""
    params = SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True)
    target, draft = cost_models()
    for draft_model in (None, "llama3-8b"):
        node = {"name": "simulated", "k": 4, "acceptance": 1.0, "draft_model": draft_model}
        llm = LLM(proposer=node, **BIG)
        executor = llm.engine.executor
        assert executor.draft_model == draft_model
        seen = []
        execute = executor.execute

        def timed(plan, execute=execute, executor=executor, seen=seen):
            before = executor.now()
            sampled = execute(plan)
            seen.append((plan, executor.now() - before))
            return sampled

        executor.execute = timed
        llm.generate([list(range(100, 164))], params)
        verified = [(plan, s) for plan, s in seen if plan.draft_counts is not None]
        assert len(verified) == 8  # 40 tokens after the prompt's: 8 x (4 drafts + 1)
        for plan, seconds in verified:
            start = int(plan.starts[0])
            want = target.step_time(verify_step(1, start, 4))
            if draft_model is not None:
                want += sum(draft.device_time(decode_step(1, start + j)) for j in range(4))
                assert want > target.step_time(verify_step(1, start, 4)) + 4 * (
                    draft.device_time(decode_step(1, 0))
                )  # every forward reads the 8B weights
            assert seconds == pytest.approx(want, rel=1e-12)
        prompt_step = seen[0][1]
        if draft_model is None:
            free = prompt_step
        else:  # the draft model computes the prompt too (its own KV)
            prefill = StepShape(np.array([64.0]), np.array([0.0]), NONE, 0)
            assert prompt_step == pytest.approx(free + draft.device_time(prefill), rel=1e-12)
            assert executor.draft_seconds > 0
            assert executor.describe()["draft_model"] == "llama3-8b"
