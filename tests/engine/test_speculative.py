"""Speculative decoding at the engine: outputs equal those without a proposer
(greedy and seeded sampling, with every sampling feature), unseeded sampling
keeps the target's distribution (a chi-square test), stops inside a kept run
cut the output where a plain run stops, prefix caching is unaffected, a broken
proposer costs only its speed-up, and the counts reach the records."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from scipy.stats import chi2_contingency

from servelab import LLM, SamplingParams
from servelab.contracts.proposer import DraftRequest, Proposer
from servelab.engine.summary import summarize
from servelab.plugins.proposers.ngram import NgramIndex
from servelab.testing.conformance import temporarily_registered

KIB = 1024


pytestmark = pytest.mark.usefixtures("test_proposers")


def tiny(proposer="none", **kwargs) -> LLM:
    options = dict(model="tiny", dtype="float64", max_model_len=128, num_threads=1)
    options.update(kwargs)
    return LLM(proposer=proposer, **options)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


REPEATING = [[5, 6, 7, 8] * 6, [9, 9, 9, 9, 9, 9], list(range(20, 60)), [3, 4, 3, 4, 3, 4, 3]]


# -- ngram's index against a brute-force search
@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    limit=st.integers(1, 5),
    split=st.integers(0, 40),
    earliest=st.booleans(),
)
def test_ngram_index_finds_the_latest_or_earliest_earlier_occurrence_of_the_longest_suffix(
    tokens, min_n, extra, limit, split, earliest
):
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n, earliest=earliest)
    index.extend(tokens[: max(1, min(split, len(tokens)))])  # indexed in two parts, as it grows
    index.extend(tokens)
    want: list[int] = []
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens):
            continue
        suffix = tokens[-n:]
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == suffix]
        if ends:
            end = ends[0] if earliest else ends[-1]
            want = tokens[end + 1 : end + 1 + limit]
            break
    assert index.continuation(tokens, limit) == want


# -- outputs unchanged
SAMPLING = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True),
    SamplingParams(
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        seed=3,
        max_tokens=20,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        logit_bias={9: 3.0, 5: 2.0},
        min_tokens=5,
        logprobs=3,
    ),  # fmt: skip
    SamplingParams(temperature=0.0, max_tokens=16, n=3, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, seed=11, max_tokens=16, n=2, ignore_eos=True),
]


@pytest.mark.parametrize("proposer", ["ngram", "repeat_last", "reference"])
@pytest.mark.parametrize("params", SAMPLING, ids=lambda p: f"t{p.temperature},n{p.n}")
def test_outputs_and_logprobs_equal_those_without_a_proposer(proposer, params):
    """`reference` drafts the plain run's own first samples (wrong at random
    positions): under sampling too, most are kept, as the target samples them."""
    plain = tiny().generate(REPEATING, params)
    node = {"name": proposer, "k": 4}
    if proposer == "reference":
        node.update(prompts=REPEATING, outputs=[o.token_ids for o in plain], wrong=0.2)
    spec_llm = tiny(node)
    spec = spec_llm.generate(REPEATING, params)
    assert tokens(spec) == tokens(plain)
    for a, b in zip(spec, plain):
        for ca, cb in zip(a.outputs, b.outputs):
            if params.logprobs is not None:
                assert [e["token_id"] for e in ca.logprobs] == ca.token_ids
                assert [e["logprob"] for e in ca.logprobs] == pytest.approx(
                    [e["logprob"] for e in cb.logprobs], abs=1e-9
                )
    stats = spec_llm.engine.scheduler.stats()
    # ngram finds nothing to copy in a random model's sampled text; the others always draft
    assert stats["spec_num_drafts"] > 0 or (proposer == "ngram" and not params.greedy)
    if proposer == "reference" and params.n == 1:  # it knows the first sample only
        assert stats["spec_num_accepted_tokens"] > stats["spec_num_draft_tokens"] // 3


def test_stop_strings_inside_a_kept_run_cut_where_a_plain_run_stops():
    """A tiny model's text, with stop strings taken from its own greedy output: a
    kept run of drafts that runs past a match is cut at the matching token."""
    prompts = ["The user says hello", "Batching is what makes", "def schedule(waiting"]
    free = tiny().generate(prompts, SamplingParams(temperature=0.0, max_tokens=30))
    cut = 0
    for prompt, out in zip(prompts, free):
        text = out.text
        for at in (len(text) // 3, len(text) // 2):
            stop = text[at : at + 2]
            if not stop.strip():
                continue
            params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop], logprobs=1)
            want = tiny().generate([prompt], params)[0]
            got = tiny({"name": "reference", "k": 5, "wrong": 0.0,
                        "prompts": [out.prompt_token_ids], "outputs": [out.token_ids]},
                       ).generate([prompt], params)[0]  # fmt: skip
            assert (got.text, got.token_ids, got.finish_reason) == (
                want.text, want.token_ids, want.finish_reason,
            )  # fmt: skip
            assert len(got.outputs[0].logprobs) == len(got.token_ids)
            cut += want.finish_reason == "stop"
    assert cut >= 3


# -- sampling keeps the target's distribution
A, B = 40, 41  # two tokens logit_bias makes likely: drafts of them are often right


def sampled_counts(llm) -> tuple[list[int], list[int]]:
    """Over the tokens a verification produced (every output token past the
    first): their category (A, B, any other), and whether each equals the one
    before it (a proposer that repeats the last token tempts a broken verifier
    to keep repeats)."""
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True,
                            logit_bias={A: 9.0, B: 8.5})  # fmt: skip
    categories, repeats = [0, 0, 0], [0, 0]
    for out in llm.generate([[7, 8, 9, 10]] * 400, params):
        ids = out.token_ids
        for before, token in zip(ids, ids[1:]):
            categories[0 if token == A else 1 if token == B else 2] += 1
            repeats[token == before] += 1
    return categories, repeats


def same_distribution(plain, spec) -> bool:
    """Chi-square tests of homogeneity (p > 0.001, fixed here) on both counts."""
    return all(chi2_contingency([a, b]).pvalue > 1e-3 for a, b in zip(plain, spec))


def test_unseeded_sampling_keeps_the_target_distribution():
    """With and without drafts, the outputs are two samples of one distribution.
    Deterministic: one engine seed (the tiny weights and the unseeded draws come from it;
    the draws differ, as the arms consume them differently)."""
    plain = sampled_counts(tiny(seed=1, max_num_seqs=64))
    spec_llm = tiny({"name": "repeat_last", "k": 3}, seed=1, max_num_seqs=64)
    spec = sampled_counts(spec_llm)
    stats = spec_llm.engine.scheduler.stats()
    kept = stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
    assert 0.15 < kept < 0.85, kept  # both paths ran: kept drafts and rejections
    assert min(plain[0] + plain[1]) > 50 and min(spec[0] + spec[1]) > 50, (plain, spec)
    assert same_distribution(plain, spec), (plain, spec)


def test_the_chi_square_test_sees_a_verifier_that_keeps_unchecked_drafts(monkeypatch):
    """The test above can fail: a verifier that keeps every draft unchecked (the
    drafts, then the target's token after them) is caught."""
    import servelab.executor.model_runner as model_runner

    def keep_drafts(samples: list[int], groups: list) -> list[int]:
        for first, drafts in groups:
            samples[first : first + len(drafts)] = drafts
        return list(range(len(samples)))

    monkeypatch.setattr(model_runner, "kept_rows", keep_drafts)
    plain = sampled_counts(tiny(seed=1, max_num_seqs=64))
    broken = sampled_counts(tiny({"name": "repeat_last", "k": 3}, seed=1, max_num_seqs=64))
    assert not same_distribution(plain, broken), (plain, broken)


# drafts drawn from a q unlike the target's (B and C too likely, A too rare): every
# branch of rejection sampling runs (A always kept, B and C often rejected, the residual
# then drawn)
FIXED_Q = {"name": "fixed_distribution", "k": 3, "weights": {A: 0.2, B: 0.5, 42: 0.3},
           "mass": 0.9}  # fmt: skip


def test_rejection_sampling_of_drafts_with_probabilities_keeps_the_target_distribution():
    plain = sampled_counts(tiny(seed=1, max_num_seqs=64))
    spec_llm = tiny(FIXED_Q, seed=1, max_num_seqs=64)
    spec = sampled_counts(spec_llm)
    stats = spec_llm.engine.scheduler.stats()
    kept = stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
    assert 0.15 < kept < 0.85, kept  # both kept drafts and rejections
    assert min(plain[0] + plain[1]) > 50 and min(spec[0] + spec[1]) > 50, (plain, spec)
    assert same_distribution(plain, spec), (plain, spec)


def test_the_chi_square_test_sees_a_rejection_that_redraws_from_the_target(monkeypatch):
    """The test above can fail: a rejection that draws the next token from p (less
    the rejected draft) instead of norm(max(0, p - q)) is caught. Written here from
    the rule, not with the engine's code."""
    import torch

    import servelab.executor.model_runner as model_runner

    def redraw_from_p(probs, tokens, groups, *_args):
        for first, drafts, q in groups:
            for i, draft in enumerate(drafts):
                p = probs[first + i]
                if torch.rand(()) * q[i, draft] < p[draft]:
                    tokens[first + i] = draft
                    continue
                p = p.clone()
                p[draft] = 0
                tokens[first + i] = int(torch.multinomial(p, 1))
                break

    monkeypatch.setattr(model_runner, "verify_by_rejection", redraw_from_p)
    plain = sampled_counts(tiny(seed=1, max_num_seqs=64))
    broken = sampled_counts(tiny(FIXED_Q, seed=1, max_num_seqs=64))
    assert not same_distribution(plain, broken), (plain, broken)


def test_drafts_with_probabilities_keep_greedy_outputs_and_seeded_ones_repeat():
    """Greedy requests ignore draft probabilities (exactly no proposer's tokens);
    a seeded sampled request gives the same tokens run after run with the same
    proposer (not those without one: the docstring of `servelab.model.rejection`)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert tokens(tiny(FIXED_Q).generate(REPEATING, greedy)) == tokens(
        tiny().generate(REPEATING, greedy))  # fmt: skip
    seeded = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=s,
                             logit_bias={A: 9.0, B: 8.5}) for s in range(4)]  # fmt: skip
    llms = [tiny(FIXED_Q) for _ in range(2)]
    runs = [tokens(llm.generate(REPEATING, seeded)) for llm in llms]
    assert runs[0] == runs[1]
    assert llms[0].engine.scheduler.stats()["spec_num_accepted_tokens"] > 0


def test_a_draft_model_sampling_as_the_request_keeps_the_target_distribution():
    """`draft_sampling: request`, the draft another random model over the same
    vocabulary (so q differs from p): the outputs are still the target's."""
    plain = sampled_counts(tiny(seed=1, max_num_seqs=64))
    node = {"name": "draft", "model": "tiny-llama", "k": 3, "draft_sampling": "request",
            "kv_cache_memory": "4MiB"}  # fmt: skip
    spec_llm = tiny(node, seed=1, max_num_seqs=64)
    spec = sampled_counts(spec_llm)
    stats = spec_llm.engine.scheduler.stats()
    kept = stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
    assert 0.05 < kept < 0.95, kept
    assert same_distribution(plain, spec), (plain, spec)


def test_a_draft_model_equal_to_the_target_keeps_every_sampled_draft():
    """The target drafting for itself at the request's own sampling: q = p, so
    rejection sampling keeps every draft; its argmax (a point mass) is kept only
    when the target samples it. Both give the target's greedy tokens when greedy."""
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=16, ignore_eos=True)
    kept = {}
    for mode in ("request", "greedy"):
        llm = tiny({"name": "draft", "model": "tiny", "k": 3, "draft_sampling": mode},
                   seed=2)  # fmt: skip
        llm.generate(REPEATING, params)
        stats = llm.engine.scheduler.stats()
        kept[mode] = stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
    assert kept["request"] == 1.0 and kept["greedy"] < 0.9, kept


def test_draft_sampling_is_checked():
    from servelab.errors import ConfigError

    with pytest.raises(ConfigError, match="draft_sampling='argmax': one of greedy, request"):
        tiny({"name": "draft", "model": "tiny", "draft_sampling": "argmax"})


def test_drafts_with_probabilities_under_a_grammar_keep_every_output_valid():
    """A constrained sampled request verifies drafts by rejection sampling against the
    masked distribution: drafts the grammar refuses have p = 0 and are rejected, the
    residual draw is masked too, so every output matches; drafts of allowed tokens are
    kept at times (q spread over the pattern's characters)."""
    import re

    pattern = r"[ab]{3,6}-[0-9]{2}"
    tokenizer = tiny().engine.tokenizer
    weights = {tokenizer.encode(c).ids[0]: 1.0 for c in "ab-0123456789"}
    llm = tiny({"name": "fixed_distribution", "k": 3, "weights": weights, "mass": 0.95})
    params = SamplingParams(temperature=1.0, max_tokens=24,
                            structured_outputs={"regex": pattern})  # fmt: skip
    outputs = llm.generate(["hello"] * 16, params)
    assert all(re.fullmatch(pattern, o.text) for o in outputs), [o.text for o in outputs]
    assert llm.engine.scheduler.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("bad", ["shape", "zero"])
def test_draft_probabilities_that_break_the_contract_cost_only_the_speed_up(bad, caplog):
    import torch

    from servelab.contracts.proposer import Draft

    class BadProbs(Proposer):
        def propose(self, requests):
            q = torch.full((1, self.vocab_size), 1.0 / self.vocab_size)
            if bad == "shape":
                q = q[:, :-1]
            else:
                q[0, 7] = 0.0
            return [Draft([7], q) for _ in requests]

    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=3)
    want = tokens(tiny().generate(REPEATING, params))
    with temporarily_registered("proposer", BadProbs) as name:
        llm = tiny({"name": name, "k": 1})
        assert tokens(llm.generate(REPEATING, params)) == want  # no drafts were verified
    assert llm.engine.scheduler.stats()["spec_proposer_errors"] > 0
    assert ("of shape" if bad == "shape" else "above 0") in caplog.text


# -- prefix caching
@pytest.mark.parametrize("allocator", [{"name": "paged", "block_size": 4, "prefix_caching": True},
                                       {"name": "radix", "page_size": 4}])  # fmt: skip
def test_prefix_cache_hits_are_the_same_with_every_proposer(allocator):
    system = list(range(40, 72))
    prompts = [system + [100 + i, 101 + i] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    rates = {}
    outputs = {}
    for proposer in ("none", "ngram", "repeat_last"):
        llm = tiny(proposer if proposer == "none" else {"name": proposer, "k": 4},
                   allocator=allocator, max_num_seqs=2)  # fmt: skip
        outputs[proposer] = tokens(llm.generate(prompts, params))
        usage = llm.engine.allocator.usage()
        rates[proposer] = (usage["prefix_hit_tokens"], usage["prefix_query_tokens"])
    assert rates["ngram"] == rates["none"] == rates["repeat_last"], rates
    assert rates["none"][0] >= 4 * 32
    assert outputs["ngram"] == outputs["none"] == outputs["repeat_last"]


# -- the core's knobs
def test_disable_above_batch_size_and_per_request_opt_out():
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 8, 12, 16)
    ]
    llm = tiny({"name": "repeat_last", "k": 2, "disable_above_batch_size": 2}, max_num_seqs=8)
    llm.generate(REPEATING, params)  # four decode at once: no drafts until two are left
    many = llm.engine.scheduler.stats()["spec_num_drafts"]
    llm2 = tiny({"name": "repeat_last", "k": 2}, max_num_seqs=8)
    llm2.generate(REPEATING, params)
    assert 0 < many < llm2.engine.scheduler.stats()["spec_num_drafts"]
    opted_out = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, speculative=False)
    llm3 = tiny({"name": "repeat_last", "k": 2})
    out = llm3.generate(REPEATING, opted_out)
    assert llm3.engine.scheduler.stats()["spec_num_drafts"] == 0
    assert all(o.metrics["drafted_tokens"] == 0 for o in out)


def test_disable_below_acceptance_pauses_a_wrong_proposer_and_resumes_a_right_one():
    """Drafts that are always wrong: after `acceptance_window` drafts the share kept
    (0) is below the floor, and only every 16th step drafts (a probe); the tokens are
    no proposer's. Then the same proposer right: the probes' kept drafts push the
    wrong ones out of the window and every step drafts again."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompts = REPEATING[:2]
    want = tiny().generate(prompts, params)
    node = {"name": "reference", "k": 3, "wrong": 1.0, "prompts": [o.prompt_token_ids for o in want],
            "outputs": [o.token_ids for o in want], "seed": 0}  # fmt: skip
    llm = tiny({**node, "disable_below_acceptance": 0.5, "acceptance_window": 12})
    assert tokens(llm.generate(prompts, params)) == tokens(want)
    stats = dict(llm.engine.scheduler.stats())
    steps = len(llm.engine.metrics.steps)
    # the window fills in at most 12 steps (a draft a sequence a step at least), then
    # 1 step in 16 drafts: far fewer drafting steps than the run's
    drafting = stats["spec_num_drafts"] / len(prompts)
    assert stats["spec_paused_steps"] > 0.6 * steps and drafting < 12 + steps / 16 + 1, (stats, steps)
    llm.engine.scheduler.speculation.proposer.wrong = 0.0  # now every draft is right
    assert tokens(llm.generate(prompts, params)) == tokens(want)
    after = llm.engine.scheduler.stats()
    assert after["spec_paused_steps"] - stats["spec_paused_steps"] <= 16 * 3  # a few probes
    # once resumed, every step drafts (but the last, whose sequences have one token left)
    second = [s.extra for s in llm.engine.metrics.steps[steps:]]
    resumed = max(i for i, s in enumerate(second) if s["spec_paused_steps"]) + 1
    assert len(second) - resumed >= 8, (resumed, len(second))
    assert all(s["spec_num_drafts"] > 0 for s in second[resumed:-1]), second[resumed:]


@pytest.mark.parametrize("bad", [{"disable_below_acceptance": 0.0}, {"disable_below_acceptance": 1.5},
                                 {"acceptance_window": 0}])  # fmt: skip
def test_acceptance_options_are_checked(bad):
    with pytest.raises(Exception, match="disable_below_acceptance|acceptance_window"):
        tiny({"name": "ngram", **bad})


def test_adaptive_k_follows_the_last_verification():
    class Counting(Proposer):
        asked: list[int] = []

        def propose(self, requests: list[DraftRequest]):
            self.asked += [r.max_drafts for r in requests]
            return [[r.last_token] * r.max_drafts for r in requests]

    with temporarily_registered("proposer", Counting) as name:
        llm = tiny({"name": name, "k": 4, "adaptive_k": True})
        llm.generate([list(range(20, 40))], SamplingParams(temperature=0.0, max_tokens=30,
                                                           ignore_eos=True))  # fmt: skip
        proposer = llm.engine.scheduler.speculation.proposer
    assert proposer.asked[0] == 4
    assert min(proposer.asked) == 1  # a rejection of the first draft: one draft next time


def test_a_broken_proposer_costs_only_its_speed_up(caplog):
    class Broken(Proposer):
        calls = 0

        def propose(self, requests):
            self.calls += 1
            if self.calls % 3 == 1:
                return [[10**6]] * len(requests)  # outside the vocabulary
            if self.calls % 3 == 2:
                raise ValueError("a bug in the proposer")
            return [[r.last_token] for r in requests]

        def on_verified(self, seq_id, drafted, accepted):
            raise KeyError(seq_id)

    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = tokens(tiny().generate(REPEATING, params))
    with temporarily_registered("proposer", Broken) as name:
        llm = tiny({"name": name, "k": 2})
        assert tokens(llm.generate(REPEATING, params)) == want
        assert tokens(llm.generate(REPEATING, params)) == want  # the next call works
    stats = llm.engine.scheduler.stats()
    assert stats["spec_proposer_errors"] > 0 and stats["spec_num_drafts"] > 0
    assert "outside" not in caplog.text or "max_drafts" in caplog.text
    usage = llm.engine.allocator.usage()
    assert usage["blocks_free"] == usage["blocks_total"]


# -- the records
def test_counts_reach_requests_steps_and_the_summary():
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = tiny({"name": "ngram", "k": 3})
    outputs = llm.generate(REPEATING, params)
    metrics = llm.engine.metrics
    stats = llm.engine.scheduler.stats()
    assert sum(o.metrics["drafted_tokens"] for o in outputs) == stats["spec_num_draft_tokens"]
    assert sum(o.metrics["accepted_tokens"] for o in outputs) == stats["spec_num_accepted_tokens"]
    for record in metrics.requests:
        assert len(record.token_steps) == len(record.token_times) == record.output_tokens
        assert record.token_steps == sorted(record.token_steps)
    summary = summarize(metrics.requests, metrics.steps)
    assert summary["spec_draft_tokens"] == stats["spec_num_draft_tokens"]
    assert summary["spec_mean_accepted_length"] == pytest.approx(
        1 + stats["spec_num_accepted_tokens"] / stats["spec_num_drafts"]
    )
    # fewer steps than tokens: kept drafts save forwards
    assert summary["steps"] < sum(o.metrics["output_tokens"] for o in outputs)
    assert (
        sum(s.extra["spec_num_draft_tokens"] for s in metrics.steps) == summary["spec_draft_tokens"]
    )


def test_the_printed_summary_has_a_speculative_section_only_with_a_proposer():
    from rich.console import Console

    from servelab.lab.runner import print_summary

    def printed(proposer) -> str:
        llm = tiny(proposer)
        llm.generate(REPEATING, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        console = Console(record=True, width=120)
        print_summary(summarize(llm.engine.metrics.requests, llm.engine.metrics.steps),
                      console=console)  # fmt: skip
        return console.export_text()

    assert "spec_mean_accepted_length" in printed({"name": "ngram", "k": 3})
    assert "speculative decoding" not in printed("none")


def test_without_a_proposer_nothing_changes_in_the_records():
    llm = tiny()
    llm.generate(REPEATING[:1], SamplingParams(temperature=0.0, max_tokens=4))
    summary = summarize(llm.engine.metrics.requests, llm.engine.metrics.steps)
    assert not any(k.startswith("spec_") for k in summary)
    assert llm.engine.scheduler.speculation is None


def test_proposer_options_are_checked():
    from servelab.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="k must be"):
        tiny({"name": "ngram", "k": 0})
    with pytest.raises((ConfigError, ValueError), match="min_n"):
        tiny({"name": "ngram", "min_n": 3, "max_n": 2})
    with pytest.raises(ConfigError, match="unknown proposer|ngram"):
        tiny("ngramm")


def test_drafts_never_exceed_the_budget_or_the_length_left():
    seen = []

    class Greedy(Proposer):
        def propose(self, requests):
            seen.extend((r.max_drafts, len(r.token_ids) - r.num_prompt_tokens) for r in requests)
            return [[random.randrange(512) for _ in range(r.max_drafts)] for r in requests]

    with temporarily_registered("proposer", Greedy) as name:
        llm = tiny({"name": name, "k": 6}, scheduler={"name": "chunked", "chunk_size": 8},
                   max_num_batched_tokens=10)  # fmt: skip
        out = llm.generate(REPEATING, SamplingParams(temperature=0.0, max_tokens=9,
                                                     ignore_eos=True))  # fmt: skip
    assert all(len(o.token_ids) == 9 for o in out)
    assert all(m <= min(6, 9 - produced - 1) for m, produced in seen)
    assert max(s.prefill_tokens + s.decode_tokens for s in llm.engine.metrics.steps) <= 10
