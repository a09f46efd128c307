"""An error inside one request's sampling or stop-string scan fails that request
only: it finishes with reason `error` and the tokens it had before the failing
step, its blocks are freed, and every other request of the step gets exactly the
tokens it gets when it runs alone (greedy, seeded, with logits processing, with
stop strings). The failure is injected by wrapping the sampler (or the stop
scan) so that it raises for one request's rows only; in one batched step that
request and the others are sampled together."""

from __future__ import annotations

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.engine import stops_and_logprobs as engine_outputs
from servelab.model.sampler import Sampler
from tests.engine.engine_checks import assert_engine_clean
from tests.serve.harness import text_model_folder

BAD_SEED = 4242  # the rows of the request whose sampling raises
MAX = 10
PROMPTS = ["the quick brown fox", "hello world", "caf\u00e9 na\u00efve", "servelab serves"]
NORMAL = [
    SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=7, max_tokens=MAX, ignore_eos=True),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=MAX, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, seed=3, stop=["zz"], max_tokens=MAX, ignore_eos=True),
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    folder = text_model_folder(tmp_path_factory.mktemp("isolation-model"))
    return LLM(model={"path": str(folder)}, dtype="float64", max_model_len=128)


@pytest.fixture(scope="module")
def alone(llm) -> list[list[int]]:
    return [llm.generate([p], s)[0].token_ids for p, s in zip(PROMPTS, NORMAL)]


def raising_sampler(monkeypatch, fail_at: int) -> None:
    """Sampler.sample raises for a batch holding a BAD_SEED row at output position >= fail_at."""
    real = Sampler.sample

    def sample(self, logits, params, positions, *args, **kwargs):
        if any(p.seed == BAD_SEED and at >= fail_at for p, at in zip(params, positions)):
            raise RuntimeError("injected sampler failure")
        return real(self, logits, params, positions, *args, **kwargs)

    monkeypatch.setattr(Sampler, "sample", sample)


@pytest.mark.parametrize("fail_at", [0, 3])  # the forking prompt step, a later decode step
def test_a_sampler_error_fails_only_its_request(llm, alone, monkeypatch, fail_at):
    bad = SamplingParams(temperature=0.7, seed=BAD_SEED, n=2, max_tokens=MAX, ignore_eos=True)
    bad_alone = llm.generate(["hello"], bad)[0]
    raising_sampler(monkeypatch, fail_at)
    outs = llm.generate(["hello", *PROMPTS], [bad, *NORMAL])
    assert outs[0].finish_reason == "error"
    assert outs[0].error == "the request failed in sampling: RuntimeError: injected sampler failure"
    # the failed request keeps the tokens it had before the failing step, no stand-in
    assert [c.token_ids for c in outs[0].outputs] == [
        c.token_ids[:fail_at] for c in bad_alone.outputs
    ]
    assert [o.token_ids for o in outs[1:]] == alone
    assert [o.finish_reason for o in outs[1:]] == ["length"] * len(NORMAL)
    assert_engine_clean(llm)


def test_a_stop_scan_error_fails_only_its_request(llm, alone, monkeypatch):
    real = engine_outputs.find_stop

    def find_stop(seq, tokenizer):
        if "BOOM" in seq.params.stop and seq.num_output_tokens >= 2:
            raise RuntimeError("injected stop-scan failure")
        return real(seq, tokenizer)

    monkeypatch.setattr(engine_outputs, "find_stop", find_stop)
    bad = SamplingParams(temperature=0.0, stop=["BOOM"], max_tokens=MAX, ignore_eos=True)
    outs = llm.generate(["hello", *PROMPTS], [bad, *NORMAL])
    assert outs[0].finish_reason == "error"
    assert outs[0].error == (
        "the request failed in the stop-string scan: RuntimeError: injected stop-scan failure"
    )
    monkeypatch.undo()
    assert outs[0].token_ids == llm.generate(["hello"], bad)[0].token_ids[:2]
    assert [o.token_ids for o in outs[1:]] == alone
    assert_engine_clean(llm)


def test_an_error_no_row_explains_fails_the_step_as_before(llm, monkeypatch):
    """When every row samples alone and only the batch raises, no request is singled out."""
    real = Sampler.sample

    def sample(self, logits, params, *args, **kwargs):
        if logits.shape[0] > 1:
            raise RuntimeError("a batch-only failure")
        return real(self, logits, params, *args, **kwargs)

    monkeypatch.setattr(Sampler, "sample", sample)
    outs = llm.generate(PROMPTS[:2], NORMAL[1])
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all("a batch-only failure" in o.error for o in outs)
    assert_engine_clean(llm)


def test_the_other_rows_draw_exactly_their_batched_tokens(monkeypatch):
    """Unseeded rows too: the retry replays the generator's state, so every row but
    the failing one gets the token the unfailed batch gives it."""
    from servelab.model.sampler import sample_isolating_rows

    torch.manual_seed(0)
    logits = torch.randn(6, 50, dtype=torch.float64)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, seed=BAD_SEED),
        SamplingParams(temperature=1.2, top_p=0.9),
        SamplingParams(temperature=0.7, seed=11),
        SamplingParams(temperature=1.0, top_k=5),
    ]
    positions, indices = [0] * 6, [0] * 6
    generator = torch.Generator().manual_seed(123)
    expected = Sampler().sample(logits, params, positions, generator, indices).tolist()
    raising_sampler(monkeypatch, 0)
    generator.manual_seed(123)
    tokens, failed = sample_isolating_rows(
        Sampler(), logits, params, positions, generator, indices, None
    )
    assert list(failed) == [2] and "injected sampler failure" in str(failed[2])
    assert [t for i, t in enumerate(tokens) if i != 2] == expected[:2] + expected[3:]
