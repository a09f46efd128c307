"""Structured outputs change which tokens are allowed, and nothing else.

The oracle here is transformers in float64 with the same xgrammar grammar applied
by hand, step by step: a fresh matcher fills the bitmask, the bits are unpacked
with numpy (not servelab's torch unpacking), disallowed logits become -inf, the
argmax is taken and fed back to the matcher. Every engine combination below must
give exactly those tokens for the constrained requests, and exactly transformers'
plain greedy tokens for the unconstrained requests batched with them. Every
finished constrained output parses and validates (jsonschema, re.fullmatch, the
choice list, the grammar's own matcher).
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr

from servelab import LLM, SamplingParams
from servelab.errors import RequestError
from servelab.model.tiny_tokenizer import tiny_tokenizer, tiny_tokenizer_json
from servelab.testing.hf_reference import build_tiny_hf, hf_greedy
from servelab.testing.oracle import OracleCase, assert_matches_reference, drive

pytestmark = pytest.mark.usefixtures("test_proposers")

VOCAB = 512  # the tiny tokenizer's
EOS = 1  # its <|endoftext|>

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "ok": {"type": "boolean"},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                           "label": {"type": "string", "pattern": "^[a-z ]{1,6}$"}},  # fmt: skip
            "required": ["x", "label"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    },
    "required": ["id", "kind", "ok", "point", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICE = ["red", "green", "blue and yellow"]
GRAMMAR = 'root ::= "(" num ("+" num){0,2} ")"\nnum ::= [0-9] [0-9]?'

CONSTRAINTS = {
    "json": {"json": SCHEMA},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICE},
    "grammar": {"grammar": GRAMMAR},
}


def xgrammar_grammar(kind: str) -> xgr.Grammar:
    """The grammar as xgrammar's own API builds it (JSON without free whitespace)."""
    if kind == "json":
        return xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(REGEX)
    if kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in CHOICE))
    return xgr.Grammar.from_ebnf(GRAMMAR)


def compiler() -> xgr.GrammarCompiler:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer())
    return xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[EOS])
    )


@torch.no_grad()
def constrained_greedy(model, compiled, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens with the grammar's mask applied at every step."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].clone()
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:VOCAB]
        logits[torch.from_numpy(bits == 0)] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if token == EOS:
            break
        assert matcher.accept_token(token)
    return out


def decode(ids: list[int]) -> str:
    return tiny_tokenizer().decode([t for t in ids if t != EOS])


def assert_valid(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE, text
    else:
        assert re.fullmatch(r"\(\d\d?(\+\d\d?){0,2}\)", text), text


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A tiny random model over the tiny tokenizer's vocabulary, saved with its
    tokenizer.json; prompts alternating constrained and unconstrained requests."""
    folder = tmp_path_factory.mktemp("structured")
    torch.manual_seed(0)
    model = build_tiny_hf("qwen3", 0, vocab_size=VOCAB)
    model.config.eos_token_id = model.generation_config.eos_token_id = EOS
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json())
    gen = torch.Generator().manual_seed(1)
    prompts, params, expected, kinds = [], [], [], []
    compiled = {kind: compiler().compile_grammar(xgrammar_grammar(kind)) for kind in CONSTRAINTS}
    for i, length in enumerate([5, 17, 9, 30, 3, 12, 22, 7, 14, 6]):
        prompt = torch.randint(4, VOCAB, (length,), generator=gen).tolist()
        kind = list(CONSTRAINTS)[i // 2 % len(CONSTRAINTS)] if i % 2 == 0 else None
        if kind is None:  # a plain request beside them: transformers' own greedy tokens
            p = SamplingParams(temperature=0.0, max_tokens=12)
            want = hf_greedy(model, prompt, 12, [EOS])
        else:
            p = SamplingParams(temperature=0.0, max_tokens=90,
                               structured_outputs=CONSTRAINTS[kind])  # fmt: skip
            want = constrained_greedy(model, compiled[kind], prompt, 90)
            assert want[-1] == EOS, f"the reference's {kind} output did not end: {want}"
        prompts.append(prompt)
        params.append(p)
        expected.append(want)
        kinds.append(kind)
    made = OracleCase(folder, prompts, params, expected, EOS)
    made.kinds = kinds
    return made


def test_the_reference_outputs_are_valid(case):
    """What the reference makes is what the grammar asks for (the test's own check)."""
    for kind, want in zip(case.kinds, case.expected):
        if kind is not None:
            assert_valid(kind, decode(want))


COMBOS = {
    "continuous-paged": {"scheduler": {"name": "continuous"},
                         "allocator": {"name": "paged", "block_size": 4},
                         "preemption": {"name": "recompute"},
                         "attention": {"name": "per_request"}},
    "chunked-prefix-swap": {"scheduler": {"name": "chunked", "chunk_size": 8,
                                          "admission": "on_demand"},
                            "allocator": {"name": "paged", "block_size": 4,
                                          "prefix_caching": True},
                            "preemption": {"name": "swap"},
                            "attention": {"name": "flash_varlen", "impl": "sdpa"}},
    "radix-hybrid": {"scheduler": {"name": "continuous", "admission": "on_demand"},
                     "allocator": {"name": "radix", "page_size": 1},
                     "preemption": {"name": "hybrid", "break_even_tokens": 16},
                     "attention": {"name": "per_request"}},
}  # fmt: skip
PROPOSERS = {
    None: None,
    "ngram": {"name": "ngram", "k": 3, "min_n": 1, "max_n": 2},
    # drafts the reference's tokens, a fifth of them wrong: the matcher accepts
    # drafts, fills their rows and rolls back, at every position
    "reference": {"name": "reference", "k": 5, "wrong": 0.2},
}


@pytest.mark.parametrize("proposer", list(PROPOSERS), ids=str)
@pytest.mark.parametrize("combo", list(COMBOS))
def test_constrained_tokens_equal_the_masked_reference(case, combo, proposer):
    """Under memory pressure (preemption), chunked prefill, prefix sharing and
    speculative decoding, constrained requests give the masked reference's tokens
    and the unconstrained ones beside them transformers' plain tokens."""
    node = dict(COMBOS[combo])
    if proposer is not None:
        node["proposer"] = dict(PROPOSERS[proposer])
        if proposer == "reference":
            node["proposer"].update(prompts=case.prompts, outputs=case.expected)
    budget = {} if combo.startswith("chunked") else {"max_num_batched_tokens": 128}
    # tight enough that every combination preempts (asserted below)
    run = drive(case, node, kv_cache_memory=128 * 1024, max_model_len=128, **budget)
    assert_matches_reference(case, node, run)
    assert run.preempted > 0, "the run never preempted: the memory was not tight"
    for kind, tokens in zip(case.kinds, run.tokens):
        if kind is not None:
            assert_valid(kind, decode(tokens))


@pytest.fixture(scope="module")
def llm(case):
    return LLM(model=str(case.folder), dtype="float64", num_threads=1)


def test_sampled_constrained_outputs_are_valid(llm):
    """Temperature 1 with top-p: every sample of every kind still validates."""
    for kind, constraint in CONSTRAINTS.items():
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, n=3, max_tokens=120,
                                structured_outputs=constraint)  # fmt: skip
        (out,) = llm.generate(["hello"], params)
        for sample in out.outputs:
            if sample.finish_reason == "stop":
                assert_valid(kind, sample.text)
            else:  # cut by max_tokens: reported as length (vLLM's rule)
                assert sample.finish_reason == "length" and len(sample.token_ids) == 120


def test_max_tokens_cutting_a_structure_is_length(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, structured_outputs={"json": SCHEMA})
    (out,) = llm.generate(["hello"], params)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3


def test_json_object_is_an_object(llm):
    params = SamplingParams(temperature=0.0, max_tokens=200,
                            structured_outputs={"json_object": True})  # fmt: skip
    (out,) = llm.generate(["hello"], params)
    assert out.outputs[0].text.startswith("{")
    if out.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(out.outputs[0].text), dict)


BAD = {
    "schema": ({"json": {"type": "object", "properties": 3}}, "properties must be an object"),
    "regex": ({"regex": "(ab"}, "parenthesis is not closed"),
    "rule": ({"grammar": 'root ::= "a" missing'}, 'Rule "missing" is not defined'),
    "enormous": ({"json": {"enum": ["x" * 1000] * 200}}, "the limit is"),
    "two kinds": ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    "choice": ({"choice": []}, "non-empty list"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_a_bad_constraint_is_refused_and_leaves_the_engine_alone(llm, bad):
    """Refused when added, naming the problem; the engine holds nothing of it and
    the next request's tokens are those it gives alone."""
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    (alone,) = llm.generate([[5, 6, 7]], plain)
    constraint, message = BAD[bad]
    with pytest.raises(RequestError, match=re.escape(message)):
        llm.engine.add_request([5, 6, 7], SamplingParams(temperature=0.0,
                                                         structured_outputs=constraint))  # fmt: skip
    assert not llm.engine.groups and not llm.engine.has_unfinished()
    (after,) = llm.generate([[5, 6, 7]], plain)
    assert after.outputs[0].token_ids == alone.outputs[0].token_ids


def test_ignore_eos_and_min_tokens_are_refused():
    with pytest.raises(RequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a+"})
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(min_tokens=3, structured_outputs={"regex": "a+"})


def test_grammars_are_compiled_once_and_a_slow_compile_fails_alone(llm):
    """A second request with the same constraint is a cache hit; a compile past
    the timeout fails its own request while another runs to the end."""
    queue = llm.engine.grammar_queue_for_constraints()
    before = dict(queue.stats())
    llm.generate(["a", "b"], SamplingParams(temperature=0.0, max_tokens=4,
                                            structured_outputs={"regex": "[0-9]{3}"}))  # fmt: skip
    stats = queue.stats()
    assert stats["grammar_compiles"] - before["grammar_compiles"] <= 1
    assert stats["grammar_cache_hits"] - before["grammar_cache_hits"] >= 1
    queue.compile_timeout_s = 0.0  # every compile not already done is too slow
    try:
        slow = SamplingParams(temperature=0.0, structured_outputs={"regex": "[a-z]{1,9}x"})
        plain = SamplingParams(temperature=0.0, max_tokens=5)
        outs = llm.generate([[5, 6], [5, 6]], [slow, plain])
    finally:
        queue.compile_timeout_s = 30.0
    assert outs[0].finish_reason == "error" and "longer than" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 5
    assert not llm.engine.has_unfinished()


def test_abort_while_compiling(llm):
    engine = llm.engine
    queue = engine.grammar_queue_for_constraints()
    request_id = engine.add_request([5, 6], SamplingParams(
        temperature=0.0, structured_outputs={"regex": "[a-z]{1,7}y"}))  # fmt: skip
    assert request_id in queue.waiting
    out = engine.abort(request_id)
    assert out is not None and out.finish_reason == "abort"
    assert not queue.waiting and not engine.has_unfinished()


def test_the_steps_record_the_masks(llm):
    llm.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=6,
                                        structured_outputs={"choice": CHOICE}))  # fmt: skip
    steps = [s.row() for s in llm.engine.metrics.steps]
    masked = [s for s in steps if s.get("grammar_masked_rows")]
    assert masked and all(s["grammar_mask_ms"] >= 0 for s in masked)


def test_a_simulated_executor_refuses_constraints():
    llm = LLM(model="tiny", executor="simulated")
    with pytest.raises(RequestError, match="stand-in tokens"):
        llm.engine.add_request([5, 6], SamplingParams(structured_outputs={"regex": "a"}))


def test_parallel_samples_each_follow_their_own_matcher(case):
    """n = 2 greedy samples fork after the prompt: each child's matcher catches up on
    its own tokens, and each sample is the masked reference."""
    combo = COMBOS["continuous-paged"]
    run = drive(case, combo, n=2, kv_cache_memory=400 * 1024, max_model_len=128,
                max_num_batched_tokens=128)  # fmt: skip
    assert_matches_reference(case, combo, run)


def test_disaggregated_constrained_requests_equal_the_reference(case):
    """Prefill on one engine (first token masked there), decode on another (its
    matcher catches up on the first token): the masked reference's tokens."""
    from servelab.testing.disaggregation import run_disaggregated

    combo = COMBOS["continuous-paged"]
    run = run_disaggregated(case, combo, kv_cache_memory=400 * 1024, max_model_len=128,
                            max_num_batched_tokens=128)  # fmt: skip
    assert run.tokens == case.expected
    assert run.handed_over == len(case.prompts)


@pytest.mark.parametrize("kernel,dtype", [("xgrammar", torch.float32), ("xgrammar", torch.bfloat16),
                                          ("table", torch.float32), ("table", torch.bfloat16),
                                          ("table", torch.float64), ("auto", torch.float64)])
@pytest.mark.parametrize("rows", [[0, 1, 2], [1], [0, 2]])
def test_both_ways_of_applying_a_bitmask_agree_with_the_bits(kernel, dtype, rows):
    """xgrammar's kernel (float32, bf16) and the table lookup (float64) set -inf
    exactly where row i's bit is 0, in the listed rows only; 300 ids (not a multiple
    of 32)."""
    from servelab.model.grammar import apply_bitmask

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 300, generator=gen).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 10), generator=gen,
                            dtype=torch.int64).to(torch.int32)  # fmt: skip
    want = logits.clone()
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little").reshape(3, -1)
    for row in rows:
        want[row, torch.from_numpy(bits[row, :300] == 0)] = float("-inf")
    apply_bitmask(logits, bitmask, rows, kernel)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float32_and_bfloat16_engines_give_valid_outputs(dtype):
    """The embedded tiny model in the serving dtypes: every output valid."""
    tiny = LLM(model="tiny", dtype=dtype)
    kinds = ["json", "regex", "choice", "grammar"]
    params = [SamplingParams(temperature=0.0, max_tokens=120,
                             structured_outputs=CONSTRAINTS[k]) for k in kinds]  # fmt: skip
    for kind, out in zip(kinds, tiny.generate(["hello", "a b", "x", "1 2 3"], params)):
        assert out.finish_reason == "stop", (kind, out.outputs[0].text)
        assert_valid(kind, out.outputs[0].text)
