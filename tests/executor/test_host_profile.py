"""Host profiles: the engine's own CPU time per step in the simulated executor, the
overlap of host and device work, and the measurement that fits a profile
(`servelab.lab.host_time`)."""

from __future__ import annotations

import numpy as np
import pytest

from servelab import LLM, SamplingParams
from servelab.errors import ConfigError
from servelab.executor.cost_model import CostModel, Shape, StepShape
from servelab.executor.hardware import load_profile
from servelab.executor.host_profile import FIGURES, HostProfile, counts, host_names, load_host
from servelab.lab import host_time
from servelab.model.config import named_config

EMPTY = np.zeros(0)
# two prompt chunks (3 and 5 new tokens after 10 and 0 cached) beside two decodes
MIXED = StepShape(np.array([3.0, 5.0]), np.array([10.0, 0.0]), np.array([7.0, 9.0]), 4)
DECODES = StepShape(EMPTY, EMPTY, np.array([7.0, 9.0, 4.0]), 3)


def test_counts_read_the_step_by_figure():
    # step, rows, mixed step, its decode rows, chunks, their keys, tokens, finishing
    assert counts(MIXED, 1) == (1, 4, 1, 2, 2, 18, 10, 1)
    assert counts(DECODES) == (1, 3, 0, 0, 0, 0, 3, 0)


def test_seconds_add_each_figure_times_its_count():
    figures = dict(zip(FIGURES, (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)))
    host = HostProfile("test", **figures)
    # by hand: 1 + 2*4 + 4 + 8*2 + 16*2 + 32*18 + 64*10 + 128*1
    assert host.seconds(MIXED, finishing=1) == 1 + 8 + 4 + 16 + 32 + 576 + 640 + 128
    assert host.seconds(DECODES) == 1 + 2 * 3 + 64 * 3


def test_a_hardware_profile_prices_its_host_work_as_before():
    profile = load_profile("h100-sxm")
    model = CostModel(Shape.of(named_config("llama3-8b")), profile, "bfloat16", 2)
    for step in (MIXED, DECODES):
        assert model.host_time(step) == profile.step_overhead + profile.seq_overhead * step.num_seqs


def test_the_shipped_host_profiles_load_with_their_sources():
    assert host_names()
    for name in host_names():
        profile = load_host(name)
        assert profile.name == name and profile.step_s > 0
        assert "servelab-calibrate --host" in profile.sources["measured"]


@pytest.mark.parametrize(
    "node, message",
    [
        ("no-such-host", "unknown host profile 'no-such-host'; known:"),
        ({"name": "x", "step": 1.0}, "unknown host profile field(s) ['step']"),
        ({"name": "x", "seq_s": -1.0}, "seq_s must be seconds >= 0"),
        ({"name": "x", "seq_s": True}, "seq_s must be seconds >= 0"),
        ({"step_s": 1.0}, "lacks its name"),
        (3, "a host profile is a name, a path or a mapping"),
    ],
)
def test_bad_host_profiles_are_named(node, message):
    with pytest.raises(ConfigError) as err:
        load_host(node)
    assert message in str(err.value)


def serve(requests=6, **executor):
    llm = LLM(model="tiny", executor={"name": "simulated", **executor}, scheduler="chunked",
              max_num_seqs=4,
              max_num_batched_tokens=64)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outputs = llm.generate([[3 + i, 4, 5, 6, 7, 8, 9, 10] for i in range(requests)], params)
    engine = llm.engine
    return engine.executor.now(), engine.metrics.steps, [o.outputs[0].token_ids for o in outputs]


ZERO = {"name": "zero"}


def test_a_host_figure_adds_its_seconds_per_counted_thing():
    base, steps, tokens = serve(host=ZERO)
    per_step, steps_b, tokens_b = serve(host={"name": "s", "step_s": 1.0})
    per_request, _, _ = serve(host={"name": "r", "request_s": 1.0})
    assert tokens_b == tokens and len(steps_b) == len(steps)
    assert per_step - base == pytest.approx(len(steps))  # one second a step
    assert per_request - base == pytest.approx(6)  # one second a request, when it finishes


def test_overlap_prices_a_step_as_the_longer_of_host_and_device():
    base, steps, tokens = serve(host=ZERO)
    assert serve(host=ZERO, overlap=True)[0] == base  # no host work: nothing to hide
    # a host second per step hides every device step but the first (the engine never
    # waited: every request arrived at once)
    total, steps_o, tokens_o = serve(host={"name": "s", "step_s": 1.0}, overlap=True)
    assert tokens_o == tokens
    assert total == pytest.approx(len(steps) + steps[0].wall_time)
    serial = serve(host={"name": "s", "step_s": 1.0})[0]
    assert serial - total == pytest.approx(base - steps[0].wall_time)


def test_fit_recovers_the_figures_that_made_the_rows():
    rng = np.random.default_rng(0)
    truth = np.array([2e-4, 1e-6, 5e-4, 4e-6, 1e-5, 1e-7, 3e-7, 3e-5])
    rows = []
    for _ in range(200):
        mixed = float(rng.random() < 0.5)
        c = [1.0, rng.integers(1, 256), mixed, mixed * rng.integers(0, 200),
             mixed * rng.integers(1, 8), mixed * rng.integers(16, 4000),
             rng.integers(1, 2048), rng.integers(0, 4)]  # fmt: skip
        rows.append({"counts": tuple(map(float, c)), "host_cpu_s": float(truth @ c)})
    figures, error = host_time.fit(rows)
    assert figures == pytest.approx(truth, rel=1e-6) and error < 1e-9


@pytest.mark.slow
def test_calibrate_host_measures_the_real_engine_and_writes_a_profile(tmp_path, monkeypatch):
    from servelab.lab.calibrate import main

    monkeypatch.setattr(host_time, "GRID", (host_time.Workload(3, 40, 6, budget=64),
                                            host_time.Workload(8, 8, 4)))  # fmt: skip
    monkeypatch.setattr(host_time, "HELD_OUT", (host_time.Workload(2, 12, 3),))
    out = tmp_path / "here.yaml"
    assert main(["--host", str(out), "--repeats", "1"]) == 0
    profile = load_host(str(out))
    assert profile.name == "here" and "tiny" in profile.sources["measured"]
    assert profile.step_s + profile.seq_s > 0
    rows = host_time.measure(host_time.Workload(3, 40, 6, budget=64))
    assert all(r["host_cpu_s"] > 0 and r["device_s"] > 0 for r in rows)
    # the rows read the steps as the simulated executor does: 3 prompts of 40 tokens and
    # 5 decodes each (the sixth token is the prompt's); each request finishes once
    assert sum(r["counts"][6] for r in rows) == 3 * 40 + 3 * 5
    assert sum(r["counts"][7] for r in rows) == 3 and rows[-1]["counts"][7] >= 1


def test_the_real_executor_hands_its_device_work_to_a_wrapper_and_the_simulated_one_refuses():
    """`Executor.wrap_device_work`: a request of 3 new tokens alone is 3 steps, each one
    forward, one LM head and one argmax; the simulated executor has no device work."""
    from servelab.engine.build import build_engine

    engine = build_engine(host_time.engine_config(host_time.Workload(1, 5, 3, budget=64), "chunked", "paged"))
    calls: list[str] = []

    def counting(fn):
        def counted(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)

        return counted

    assert engine.executor.wrap_device_work(counting) is True
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert sorted(calls) == sorted(["run_model", "logits", "argmax"] * 3)
    simulated = build_engine({**host_time.engine_config(host_time.Workload(1, 5, 3, budget=64), "chunked", "paged"),
                              "executor": "simulated"})  # fmt: skip
    assert simulated.executor.wrap_device_work(counting) is False
    with pytest.raises(ConfigError, match="cannot time its device work apart"):
        host_time.instrument(simulated)
