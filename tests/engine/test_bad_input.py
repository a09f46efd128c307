"""Every bad request argument is a RequestError that names the problem, raised
before the request exists: through `generate` it comes back as that prompt's
rejected output while the other prompts finish with a clean run's tokens, the
allocator's integrity holds and no KV block leaks; through `add_request` it
raises and leaves the engine as it was. Values a user would reasonably pass
(numpy or torch integer ids, tuples, numpy integers) are accepted and give the
same tokens as plain lists."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from servelab import LLM, RequestError, SamplingParams
from tests.engine.engine_checks import assert_engine_clean

GOOD = [5, 6, 7, 8]
GREEDY = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
VOCAB = 512  # the tiny model's (checked in the fixture)
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM(model="tiny", max_model_len=MAX_MODEL_LEN, kv_cache_memory="4MiB")
    assert llm.engine.model_config.vocab_size == VOCAB
    return llm


@pytest.fixture(scope="module")
def clean_tokens(llm) -> list[int]:
    return llm.generate([GOOD], SamplingParams(**GREEDY))[0].token_ids


def params(**changes) -> SamplingParams:
    return SamplingParams(**{**GREEDY, **changes})


class Changes(dict):
    """The bad fields of a SamplingParams: the constructor refuses them, so the
    engine's own check is reached by changing a valid one afterwards."""


def changed(**changes) -> Changes:
    return Changes(changes)


def changed_after_construction(changes: dict) -> SamplingParams:
    made = params()
    for name, value in changes.items():
        setattr(made, name, value)
    return made


# only the engine knows its vocabulary: these pass the constructor
VOCABULARY_CASES = {"stop-outside", "stop-negative"}

# (case id, the bad fields (or a bad params argument), what the message must say)
BAD_PARAMS = [
    ("seed-str", changed(seed="abc"), "seed must be an integer"),
    ("seed-float", changed(seed=1.5), "seed must be an integer"),
    ("seed-bool", changed(seed=True), "seed must be an integer"),
    ("seed-list", changed(seed=[1]), "seed must be an integer"),
    ("stop-None", changed(stop_token_ids=None), "stop_token_ids must be a list"),
    ("stop-int", changed(stop_token_ids=7), "stop_token_ids must be a list"),
    ("stop-str", changed(stop_token_ids="1,2"), "stop_token_ids must be a list"),
    ("stop-float", changed(stop_token_ids=[1.5]), "integer token ids, got 1.5"),
    ("stop-bool", changed(stop_token_ids=[True]), "integer token ids, got True"),
    ("stop-nested", changed(stop_token_ids=[[1]]), "integer token ids"),
    ("stop-outside", changed(stop_token_ids=[VOCAB]), f"stop token id {VOCAB} is outside"),
    ("stop-negative", changed(stop_token_ids=[-1]), "stop token id -1 is outside"),
    ("top_p-str", changed(top_p="0.5"), "top_p must be a finite number in (0, 1]"),
    ("top_p-zero", changed(top_p=0), "top_p must be a finite number in (0, 1]"),
    ("top_p-big", changed(top_p=1.5), "top_p"),
    ("top_p-nan", changed(top_p=math.nan), "top_p"),
    ("temperature-negative", changed(temperature=-1), "temperature must be a finite number >= 0"),
    ("temperature-inf", changed(temperature=math.inf), "temperature"),
    ("temperature-nan", changed(temperature=math.nan), "temperature"),
    ("temperature-str", changed(temperature="0"), "temperature"),
    ("temperature-bool", changed(temperature=True), "temperature"),
    ("temperature-huge-int", changed(temperature=10**400), "temperature"),
    ("top_k-below", changed(top_k=-2), "top_k must be an integer"),
    ("top_k-float", changed(top_k=1.5), "top_k"),
    ("top_k-str", changed(top_k="3"), "top_k"),
    ("max_tokens-zero", changed(max_tokens=0), "max_tokens must be an integer >= 1"),
    ("max_tokens-float", changed(max_tokens=2.5), "max_tokens"),
    ("max_tokens-str", changed(max_tokens="4"), "max_tokens"),
    ("max_tokens-bool", changed(max_tokens=True), "max_tokens"),
    ("max_tokens-None", changed(max_tokens=None), "max_tokens"),
    ("n-zero", changed(n=0), "n must be an integer >= 1"),
    ("n-float", changed(n=1.5), "n must be an integer"),
    ("n-str", changed(n="2"), "n must be an integer"),
    ("ignore_eos-str", changed(ignore_eos="no"), "ignore_eos must be true or false"),
    ("ignore_eos-int", changed(ignore_eos=2), "ignore_eos must be true or false"),
    ("ignore_eos-None", changed(ignore_eos=None), "ignore_eos must be true or false"),
    ("params-dict", dict(max_tokens=2), "params must be a SamplingParams, got dict"),
    ("params-str", "greedy", "params must be a SamplingParams, got str"),
    ("params-int", 3, "params must be a SamplingParams, got int"),
]

# (case id, the bad prompt, what the message must say)
BAD_PROMPTS = [
    ("None", None, "a prompt is text or a list of token ids, got NoneType"),
    ("int", 7, "got int"),
    ("float", 7.0, "got float"),
    ("dict", {"ids": [1]}, "got dict"),
    ("set", {1, 2}, "got set"),
    ("bytes", b"\x01\x02", "got bytes"),
    ("empty", [], "the prompt is empty"),
    ("empty-tuple", (), "the prompt is empty"),
    ("bool-id", [4, True], "token ids must be integers, got True (bool)"),
    ("float-id", [4, 1.5], "got 1.5 (float)"),
    ("whole-float-id", [4.0], "got 4.0 (float)"),
    ("str-id", ["a"], "got 'a' (str)"),
    ("nested", [[1, 2]], "got [1, 2] (list)"),
    ("None-id", [1, None], "got None (NoneType)"),
    ("negative-id", [-1], "token id -1 is outside the vocabulary"),
    ("id-at-vocab", [VOCAB], f"token id {VOCAB} is outside the vocabulary [0, {VOCAB})"),
    ("huge-id", [10**30], "is outside the vocabulary"),
    ("float-array", np.array([1.0, 2.0]), "integer dtype"),
    ("2d-array", np.zeros((2, 2), dtype=np.int64), "must be 1-D"),
    ("bool-tensor", torch.tensor([True, False]), "integer dtype"),
    ("float-tensor", torch.tensor([1.0]), "integer dtype"),
    ("too-long", list(range(1, MAX_MODEL_LEN + 2)), f"longer than max_model_len={MAX_MODEL_LEN}"),
]


@pytest.mark.parametrize("case,bad,message", BAD_PARAMS, ids=[c[0] for c in BAD_PARAMS])
def test_bad_sampling_params_reject_only_their_request(llm, clean_tokens, case, bad, message):
    if isinstance(bad, Changes):
        bad = changed_after_construction(bad)
    good, rejected, good_again = llm.generate([GOOD, GOOD, GOOD], [params(), bad, params()])
    assert rejected.finish_reason == "rejected" and message in rejected.error, rejected.error
    assert good.token_ids == clean_tokens and good_again.token_ids == clean_tokens
    assert_engine_clean(llm)


FIELD_CASES = [c for c in BAD_PARAMS if isinstance(c[1], Changes)]


@pytest.mark.parametrize("case,bad,message", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_sampling_params_refuse_a_bad_field_at_construction(case, bad, message):
    if case in VOCABULARY_CASES:
        assert params(**bad).stop_token_ids == bad["stop_token_ids"]
        return
    with pytest.raises(RequestError) as refused:
        params(**bad)
    assert message in str(refused.value)


@pytest.mark.parametrize("case,bad,message", BAD_PROMPTS, ids=[c[0] for c in BAD_PROMPTS])
def test_bad_prompts_reject_only_their_request(llm, clean_tokens, case, bad, message):
    good, rejected = llm.generate([GOOD, bad], params())
    assert rejected.finish_reason == "rejected" and message in rejected.error, rejected.error
    assert good.token_ids == clean_tokens
    assert_engine_clean(llm)


def test_a_text_prompt_without_a_tokenizer_rejects_only_its_request():
    llm = LLM(model="bench", max_model_len=MAX_MODEL_LEN, kv_cache_memory="4MiB")  # no tokenizer
    good, rejected = llm.generate([GOOD, "hello"], params())
    assert rejected.finish_reason == "rejected"
    assert "a text prompt needs a tokenizer" in rejected.error, rejected.error
    assert good.finish_reason is not None and good.error is None
    assert_engine_clean(llm)


BAD_ARGUMENTS = [
    ("priority-None", dict(priority=None), "priority must be an integer"),
    ("priority-str", dict(priority="high"), "priority must be an integer"),
    ("priority-float", dict(priority=1.5), "priority must be an integer"),
    ("priority-bool", dict(priority=True), "priority must be an integer"),
    ("arrival-str", dict(arrival_time="soon"), "arrival_time must be a finite number"),
    ("arrival-inf", dict(arrival_time=math.inf), "arrival_time must be a finite number"),
    ("arrival-nan", dict(arrival_time=math.nan), "arrival_time"),
    ("arrival-bool", dict(arrival_time=False), "arrival_time"),
    ("id-empty", dict(request_id=""), "request_id must not be empty"),
    ("id-float", dict(request_id=1.5), "request_id must be a string"),
    ("id-list", dict(request_id=["a"]), "request_id must be a string"),
    ("client-int", dict(client=3), "client must be a non-empty string or None"),
    ("client-empty", dict(client=""), "client must be a non-empty string or None"),
    ("client-list", dict(client=["a"]), "client must be a non-empty string or None"),
]


@pytest.mark.parametrize("case,kwargs,message", BAD_ARGUMENTS, ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_add_request_arguments_raise_and_change_nothing(
    llm, clean_tokens, case, kwargs, message
):
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        llm.engine.add_request(GOOD, params(), **kwargs)
    assert_engine_clean(llm)
    assert llm.generate([GOOD], params())[0].token_ids == clean_tokens


def test_a_request_id_in_use_is_refused_and_the_first_keeps_running(llm, clean_tokens):
    engine = llm.engine
    engine.add_request(GOOD, params(), request_id="mine")
    with pytest.raises(RequestError, match="request id 'mine' is already in use"):
        engine.add_request([9, 9], params(), request_id="mine")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [(o.request_id, o.token_ids) for o in outputs] == [("mine", clean_tokens)]
    assert_engine_clean(llm)


ACCEPTED = [
    ("tuple", tuple(GOOD)),
    ("numpy-ints", [np.int64(t) for t in GOOD]),
    ("numpy-array", np.array(GOOD, dtype=np.int32)),
    ("torch-tensor", torch.tensor(GOOD)),
]


@pytest.mark.parametrize("case,prompt", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_integer_prompts_of_every_kind_give_the_same_tokens(llm, clean_tokens, case, prompt):
    (out,) = llm.generate([prompt], params())
    assert out.error is None and out.token_ids == clean_tokens
    assert out.prompt_token_ids == GOOD and all(type(t) is int for t in out.prompt_token_ids)


def test_numpy_values_in_sampling_params_are_accepted(llm, clean_tokens):
    numpy_params = params(
        max_tokens=np.int64(4), stop_token_ids=np.array([VOCAB - 1]), seed=np.int32(3)
    )
    (out,) = llm.generate([GOOD], numpy_params)
    assert (
        out.error is None
        and out.token_ids[: len(clean_tokens)] == clean_tokens[: len(out.token_ids)]
    )
    # plain Python values from construction on
    assert type(numpy_params.max_tokens) is int and numpy_params.stop_token_ids == [VOCAB - 1]


# -- generate() touches only its own requests


def test_generate_leaves_requests_it_did_not_add_to_their_owner(llm, clean_tokens):
    engine = llm.engine
    engine.add_request([40, 41], params(), request_id="gen-3")  # an id generate could pick
    engine.add_request([9, 10, 11], params(), request_id="1")  # and one like the automatic ids
    outs = llm.generate([[9, 10, 11], [40, 41], GOOD], params())
    alone = [llm.generate([p], params())[0].token_ids for p in ([9, 10, 11], [40, 41])]
    assert [o.token_ids for o in outs] == [*alone, clean_tokens]
    assert {o.request_id for o in outs}.isdisjoint({"gen-3", "1"})
    kept = {o.request_id: o.token_ids for o in llm.loop.take_finished()}
    assert kept == {"gen-3": alone[1], "1": alone[0]}
    assert llm.loop.take_finished() == []  # each handed over once
    assert_engine_clean(llm)
