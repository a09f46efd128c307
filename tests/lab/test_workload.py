"""Workloads: the mixed_lengths mix, seeded length distributions, arrival processes,
shared prefixes, long-prompt interference, JSONL traces; serving against the
wall clock; the static batcher's "enough requests or a timeout"."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from servelab.engine.build import build_engine
from servelab.errors import ConfigError
from servelab.lab.runner import serve
from servelab.lab.workload import (
    MIXED_LENGTHS,
    LengthDist,
    arrival_times,
    make_workload,
    workload_options,
)

VOCAB = 512


def lengths(requests):
    return [(len(r.prompt_token_ids), r.params.max_tokens) for r in requests]


# -- the mixed_lengths mix and synthetic lengths


def test_mixed_lengths_is_the_mix_in_order_repeated_and_scaled():
    assert lengths(make_workload({"name": "mixed_lengths"}, VOCAB)) == MIXED_LENGTHS
    repeated = make_workload({"name": "mixed_lengths", "repeat": 3}, VOCAB)
    assert lengths(repeated) == MIXED_LENGTHS * 3
    half = make_workload({"name": "mixed_lengths", "scale": 0.5}, VOCAB)
    assert lengths(half) == [(round(p / 2), round(o / 2)) for p, o in MIXED_LENGTHS]
    assert all(r.arrival_time == 0.0 and r.params.ignore_eos for r in repeated)


def test_same_seed_same_requests_other_seed_other_tokens():
    node = {"name": "synthetic", "num_requests": 8, "seed": 3}
    a, b = make_workload(node, VOCAB), make_workload(node, VOCAB)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    c = make_workload({**node, "seed": 4}, VOCAB)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert all(2 <= t < VOCAB for r in a for t in r.prompt_token_ids)


def test_fixed_and_uniform_lengths():
    rng = np.random.default_rng(0)
    assert LengthDist("fixed", mean=37).sample(rng, 5).tolist() == [37] * 5
    draws = LengthDist("uniform", min=10, max=13).sample(rng, 4000)
    assert draws.min() == 10 and draws.max() == 13  # both ends included
    assert abs(draws.mean() - 11.5) < 0.1


@pytest.mark.parametrize("dist", ["normal", "lognormal"])
def test_normal_and_lognormal_have_the_asked_mean_and_std(dist):
    # clip bounds far away, so the draws keep the distribution's own moments
    spec = LengthDist(dist, mean=200, std=60, min=1, max=100_000)
    draws = spec.sample(np.random.default_rng(1), 40_000)
    assert abs(draws.mean() - 200) < 2
    assert abs(draws.std() - 60) < 2
    if dist == "lognormal":  # right-skewed: the median sits below the mean
        assert np.median(draws) < 195


def test_lengths_are_clipped_to_min_max_and_to_max_model_len():
    spec = LengthDist("normal", mean=100, std=500, min=20, max=150)
    draws = spec.sample(np.random.default_rng(2), 2000)
    assert draws.min() == 20 and draws.max() == 150
    node = {
        "name": "synthetic",
        "num_requests": 50,
        "prompt_len": {"dist": "uniform", "min": 50, "max": 120},
        "output_len": {"dist": "uniform", "min": 50, "max": 120},
    }
    for prompt, output in lengths(make_workload(node, VOCAB, max_model_len=128)):
        assert prompt >= 1 and output >= 1 and prompt + output <= 128


# -- arrivals


def test_all_at_once_is_all_zero():
    assert arrival_times(5, "all_at_once", 1.0, 1.0, np.random.default_rng(0)).tolist() == [0.0] * 5


@pytest.mark.parametrize(("arrival", "cv"), [("poisson", 1.0), ("gamma", 0.5), ("gamma", 3.0)])
def test_arrival_gaps_have_the_asked_rate_and_burstiness(arrival, cv):
    times = arrival_times(40_001, arrival, 20.0, cv, np.random.default_rng(0))
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 1 / 20) < 0.05 / 20 * 3
    assert abs(gaps.std() / gaps.mean() - cv) < 0.08 * cv


def test_synthetic_arrivals_are_sorted_and_seeded():
    node = {"name": "synthetic", "num_requests": 20, "arrival": "poisson", "rate": 10.0}
    times = [r.arrival_time for r in make_workload(node, VOCAB)]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] > 0.5
    assert times == [r.arrival_time for r in make_workload(node, VOCAB)]


# -- shared prefix and interference


def test_shared_system_prompt_on_exactly_the_asked_fraction():
    node = {
        "name": "synthetic",
        "num_requests": 20,
        "shared_prefix_len": 40,
        "shared_fraction": 0.25,
        "prompt_len": {"dist": "fixed", "mean": 10},
    }
    requests = make_workload(node, VOCAB)
    sharing = [r for r in requests if r.meta["shared_prefix"]]
    assert len(sharing) == 5
    prefix = sharing[0].prompt_token_ids[:40]
    assert all(r.prompt_token_ids[:40] == prefix and len(r.prompt_token_ids) == 50 for r in sharing)
    others = [r for r in requests if not r.meta["shared_prefix"]]
    assert all(len(r.prompt_token_ids) == 10 for r in others)


def test_interference_mix_has_steady_decoders_and_periodic_long_prompts():
    node = {
        "name": "interference",
        "num_decoders": 3,
        "decoder_output_len": 50,
        "num_long": 3,
        "long_prompt_len": 300,
        "first_long_at": 0.2,
        "long_every": 0.5,
    }
    requests = make_workload(node, VOCAB)
    decoders = [r for r in requests if r.meta["kind"] == "decoder"]
    longs = [r for r in requests if r.meta["kind"] == "long"]
    assert [r.arrival_time for r in decoders] == [0.0] * 3
    assert all(r.params.max_tokens == 50 for r in decoders)
    assert [r.arrival_time for r in longs] == pytest.approx([0.2, 0.7, 1.2])
    assert all(len(r.prompt_token_ids) == 300 for r in longs)


def test_a_shared_prefix_longer_than_the_engine_allows_is_cut():
    node = {
        "name": "synthetic",
        "num_requests": 4,
        "shared_prefix_len": 100,
        "shared_fraction": 1.0,
        "prompt_len": 10,
        "output_len": 5,
    }
    full = make_workload(node, VOCAB)
    assert all(len(r.prompt_token_ids) == 110 for r in full)
    cut = make_workload(node, VOCAB, max_model_len=64)
    # one token is left for the output: the prompt keeps the prefix's first 63 tokens
    system = full[0].prompt_token_ids[:100]
    assert [r.prompt_token_ids for r in cut] == [system[:63]] * 4
    assert [r.params.max_tokens for r in cut] == [1] * 4


@pytest.mark.parametrize(
    "node",
    [
        {"name": "mixed_lengths", "repeat": 2},
        {"name": "synthetic", "num_requests": 16},
        {"name": "interference", "num_decoders": 5, "num_long": 3},
    ],
)
def test_every_sampled_request_has_its_own_seed_and_greedy_ones_none(node):
    sampled = make_workload({**node, "temperature": 0.8}, VOCAB)
    seeds = [r.params.seed for r in sampled]
    assert None not in seeds and len(set(seeds)) == len(seeds)
    # another workload seed gives every request another sampling seed
    other = make_workload({**node, "temperature": 0.8, "seed": 1}, VOCAB)
    assert not set(seeds) & {r.params.seed for r in other}
    greedy = make_workload(node, VOCAB)
    assert all(r.params.seed is None for r in greedy)


# -- traces


def write_trace(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    )
    return str(path)


def test_trace_is_replayed_line_by_line(tmp_path):
    path = write_trace(
        tmp_path,
        [
            {"prompt_len": 5, "output_len": 3, "arrival_time": 0.5, "priority": 2},
            "",
            {"prompt_token_ids": [7, 8, 9], "output_len": 4},
        ],
    )
    requests = make_workload({"name": "trace", "path": path, "time_scale": 2.0}, VOCAB)
    assert [r.arrival_time for r in requests] == [0.0, 1.0]  # sorted; 0.5 s x time_scale 2
    assert requests[0].prompt_token_ids == [7, 8, 9] and requests[0].params.max_tokens == 4
    assert len(requests[1].prompt_token_ids) == 5 and requests[1].priority == 2


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"output_len": 3}', "exactly one of prompt_len and prompt_token_ids"),
        ('{"prompt_len": 3, "prompt_token_ids": [1], "output_len": 3}', "exactly one of"),
        ('{"prompt_len": 3}', "missing output_len"),
        ('{"prompt_len": 0, "output_len": 3}', "prompt_len must be an integer >= 1"),
        ('{"prompt_len": 3, "output_len": 2.5}', "output_len must be an integer >= 1"),
        ('{"prompt_token_ids": [1, 99999], "output_len": 3}', "outside the vocabulary"),
        ('{"prompt_len": 3, "output_len": 3, "arrival_time": -1}', "arrival_time must be"),
        ('{"prompt_len": 3, "output_len": 3, "priority": "high"}', "priority must be an integer"),
        ('{"prompt_len": 3, "output_len": 3, "prompt": "hi"}', "unknown key(s) ['prompt']"),
    ],
)
def test_a_bad_trace_line_names_its_line_and_problem(tmp_path, line, problem):
    path = write_trace(tmp_path, [{"prompt_len": 4, "output_len": 2}, "", line])
    with pytest.raises(ConfigError) as err:
        make_workload({"name": "trace", "path": path}, VOCAB)
    assert "trace.jsonl:3:" in str(err.value) and problem in str(err.value)


def test_trace_without_a_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="needs `path`"):
        make_workload({"name": "trace"}, VOCAB)
    with pytest.raises(ConfigError, match="no such file"):
        make_workload({"name": "trace", "path": str(tmp_path / "missing.jsonl")}, VOCAB)
    path = write_trace(tmp_path, [{"prompt_len": 100, "output_len": 100}])
    with pytest.raises(ConfigError, match=r"trace.jsonl:1: .*exceeds max_model_len=64"):
        make_workload({"name": "trace", "path": path}, VOCAB, max_model_len=64)


# -- validation


def test_unknown_workload_option_lists_the_accepted_ones():
    with pytest.raises(ConfigError) as err:
        make_workload({"name": "synthetic", "num_request": 3}, VOCAB)
    message = str(err.value)
    assert "'num_request'" in message
    assert all(key in message for key in workload_options("synthetic"))
    with pytest.raises(ConfigError, match="accepted: dist, mean, std, min, max"):
        make_workload({"name": "synthetic", "prompt_len": {"dist": "fixed", "meen": 3}}, VOCAB)
    with pytest.raises(
        ConfigError, match="accepted: mixed_lengths, synthetic, interference, trace"
    ):
        make_workload({"name": "lmsys_chat"}, VOCAB)


@pytest.mark.parametrize(
    ("node", "problem"),
    [
        ({"name": "synthetic", "arrival": "bursty"}, "accepted: all_at_once, poisson, gamma"),
        ({"name": "synthetic", "arrival": "poisson", "rate": 0}, "rate must be > 0"),
        ({"name": "synthetic", "arrival": "gamma", "cv": -1.0}, "cv must be > 0"),
        ({"name": "synthetic", "prompt_len": {"dist": "zipf"}}, "accepted: fixed, uniform"),
        (
            {"name": "synthetic", "output_len": {"dist": "uniform", "min": 9, "max": 3}},
            "min <= max",
        ),
        ({"name": "synthetic", "shared_fraction": 1.5}, "shared_fraction must be in [0, 1]"),
        ({"name": "mixed_lengths", "repeat": 0}, "repeat must be an integer >= 1"),
    ],
)
def test_bad_workload_values_are_config_errors(node, problem):
    with pytest.raises(ConfigError) as err:
        make_workload(node, VOCAB)
    assert problem in str(err.value)


# -- serving against the wall clock


def tiny_engine(**scheduler):
    node = {"name": scheduler.pop("name", "continuous"), **scheduler}
    return build_engine({"model": "tiny", "scheduler": node, "engine": {"num_threads": 1}})


def test_requests_enter_the_engine_when_their_time_comes():
    node = {
        "name": "synthetic",
        "num_requests": 6,
        "arrival": "poisson",
        "rate": 40.0,
        "prompt_len": {"dist": "fixed", "mean": 8},
        "output_len": {"dist": "fixed", "mean": 3},
    }
    engine = tiny_engine()
    requests = make_workload(node, engine.model_config.vocab_size)
    before = engine.now()
    summary = serve(engine, requests)
    assert summary["requests"] == 6
    records = {r.request_id: r for r in engine.metrics.requests}
    # every arrival is stamped on one shared origin (the moment serve began), so
    # each stamp minus its scheduled offset is that same origin, whatever the
    # machine's load made of the wall clock between the calls
    origins = [records[r.request_id].arrival_time - r.arrival_time for r in requests]
    origin = origins[0]
    assert origins == pytest.approx([origin] * len(origins), abs=1e-9)
    assert origin >= before
    for req in requests:
        # never scheduled before it arrived
        assert records[req.request_id].first_scheduled_time >= origin + req.arrival_time
    last_arrival = origin + max(r.arrival_time for r in requests)
    assert engine.metrics.steps[-1].start_time >= last_arrival


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_static_batcher_waits_for_batch_size_or_timeout():
    engine = tiny_engine(name="static", batch_size=3, batch_timeout=0.5)
    clock = FakeClock()
    engine.scheduler.policy.clock = clock
    params = dict(max_tokens=2, temperature=0.0, ignore_eos=True)
    from servelab.step.sequence import SamplingParams

    engine.add_request([5, 6, 7], SamplingParams(**params), request_id="a")
    clock.now = 0.2
    engine.add_request([5, 6], SamplingParams(**params), request_id="b")
    clock.now = 0.49  # two wait, the oldest for 0.49 s: no batch yet
    engine.step()
    assert engine.metrics.steps == []  # nothing ran, so no step was recorded
    clock.now = 0.5  # the oldest has waited batch_timeout: a batch of two forms
    engine.step()
    assert engine.metrics.steps[-1].num_seqs == 2
    # while it runs, newcomers wait even when they alone would make a full batch
    for name in "cde":
        engine.add_request([9, 9], SamplingParams(**params), request_id=name)
    while any(engine.groups.get(r) for r in "ab"):
        engine.step()
    # batch_size requests wait: the next batch forms without any timeout
    engine.step()
    assert engine.metrics.steps[-1].num_seqs == 3
    while engine.has_unfinished():
        engine.step()
    assert {r.request_id for r in engine.metrics.requests} == set("abcde")


def test_static_batch_never_exceeds_batch_size():
    engine = tiny_engine(name="static", batch_size=2)
    requests = make_workload(
        {"name": "mixed_lengths", "scale": 0.05}, engine.model_config.vocab_size
    )
    serve(engine, requests)
    batches: dict[int, int] = {}
    for record in engine.metrics.requests:
        batches[record.first_scheduled_step] = batches.get(record.first_scheduled_step, 0) + 1
    assert len(batches) == math.ceil(len(requests) / 2)
    assert max(batches.values()) == 2


@pytest.mark.parametrize(
    ("options", "problem"),
    [({"batch_size": 0}, "batch_size must be null or an integer >= 1"),
     ({"batch_timeout": -1}, "batch_timeout must be a finite number >= 0"),
     ({"batch_timeout": math.inf}, "batch_timeout must be a finite number"),
     ({"batch_timeout": "1"}, "batch_timeout must be a finite number"),
     ({"batch_timeout": True}, "batch_timeout must be a finite number")],
)  # fmt: skip
def test_static_batcher_options_are_validated(options, problem):
    with pytest.raises(ConfigError, match=problem):
        tiny_engine(name="static", **options)
