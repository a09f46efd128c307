"""Stop strings and logprobs in the offline API: a stop string ends the text
before its first match, the tokens stop at the one completing it; logprobs are
the float32 log-softmax of the logits transformers computes for each position."""

from __future__ import annotations

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.errors import RequestError
from tests.serve.harness import boundary_stop

PROMPTS = ["hello world", "the quick brown fox", "caf\u00e9 r\u00e9sum\u00e9"]


@pytest.fixture(scope="module")
def llm(model_folder):
    return LLM(model={"path": str(model_folder)}, dtype="float64", max_model_len=256)


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw)


def test_stop_string_ends_at_first_match_across_tokens(llm):
    tok = llm.engine.tokenizer
    for full in llm.generate(PROMPTS, greedy()):
        stop, keep = boundary_stop(tok, full.token_ids)
        out = llm.generate([full.prompt_token_ids], greedy(stop=["never-there", stop]))[0]
        text = tok.decode(full.token_ids[:keep])
        assert out.text == text[: text.find(stop)] and stop not in out.text
        assert out.finish_reason == "stop"
        assert out.token_ids == full.token_ids[:keep]  # up to the token completing the match


def test_stop_strings_leave_other_requests_and_samples_alone(llm):
    plain = llm.generate(PROMPTS, greedy())
    mixed = llm.generate(PROMPTS, [greedy(stop=["zzzz-none"]), greedy(), greedy(stop=["\x00\x01"])])
    assert [o.token_ids for o in mixed] == [o.token_ids for o in plain]


def test_bad_stop_and_logprobs_values_are_rejected():
    with pytest.raises(RequestError, match="stop"):
        SamplingParams(stop=[""])
    with pytest.raises(RequestError, match="stop"):
        SamplingParams(stop=[3])
    with pytest.raises(RequestError, match="logprobs"):
        SamplingParams(logprobs=-1)
    assert SamplingParams(stop="x").stop == ["x"]


def test_logprobs_match_transformers(llm, model_folder):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float64).eval()
    outs = llm.generate(PROMPTS, greedy(logprobs=3))
    for out in outs:
        ids = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0]
        want = logits.float().log_softmax(-1)[len(out.prompt_token_ids) - 1 : -1]
        got = out.outputs[0].logprobs
        assert len(got) == len(out.token_ids)
        for pos, entry in enumerate(got):
            assert entry["token_id"] == out.token_ids[pos]
            assert entry["logprob"] == pytest.approx(want[pos, entry["token_id"]].item(), abs=1e-4)
            top_ids = [t for t, _ in entry["top"]]
            assert len(top_ids) == 3 and top_ids[0] == entry["token_id"]  # greedy: the best
            assert top_ids == want[pos].topk(3).indices.tolist()


def test_logprobs_follow_each_sample_and_leave_tokens_alone(llm):
    params = SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=10, ignore_eos=True)
    plain = llm.generate(PROMPTS, params)
    with_lp = llm.generate(PROMPTS, SamplingParams(**{**vars(params), "logprobs": 0}))
    for a, b in zip(plain, with_lp):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for c in b.outputs:
            assert [e["token_id"] for e in c.logprobs] == c.token_ids
            assert all(e["top"] == [] and e["logprob"] <= 0 for e in c.logprobs)
    assert plain[0].outputs[0].logprobs is None
