"""What sjf promises: shortest predicted work first, bounded waiting with
ageing, a JSONL step trace, and `scheduler=sjf` as a Hydra config option."""

from __future__ import annotations

import inspect
import json

import pytest
from servelab import LLM, SamplingParams, build_engine
from servelab.registry.plugin_manager import get_plugin_manager
from servelab.scheduling import SchedulingPolicy

from servelab_sjf import TRACE_ENV, ShortestJobFirst

PROMPT = [3, 4, 5]


def one_at_a_time(**options) -> LLM:
    """A tiny engine serving one request at a time: admission order is finishing order."""
    return LLM(model="tiny", scheduler={"name": "sjf", **options}, max_num_seqs=1, num_threads=1)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_admits_the_shortest_request_first(sjf_plugin):
    lengths = [5, 1, 4, 2, 3]
    engine = one_at_a_time().engine
    for i, n in enumerate(lengths):
        engine.add_request(PROMPT, params(n), request_id=f"r{i}")
    finished = []
    while engine.has_unfinished():
        finished += [out.request_id for out in engine.step()]
    assert finished == [f"r{i}" for i in sorted(range(len(lengths)), key=lengths.__getitem__)]


@pytest.mark.parametrize("ageing", [0.0, 1.0, 0.5])
def test_ageing_bounds_the_wait_behind_a_stream_of_short_requests(sjf_plugin, ageing):
    long_tokens, steps = 8, 40
    engine = one_at_a_time(ageing=ageing).engine
    engine.add_request(PROMPT, params(long_tokens), request_id="long")
    finished_at = None
    for step in range(steps):
        engine.add_request(PROMPT, params(1), request_id=f"short-{step}")  # one more every step
        if any(out.request_id == "long" for out in engine.step()):
            finished_at = step
    if ageing == 0.0:
        assert finished_at is None, "pure SJF let the long request overtake shorter ones"
    else:
        # admitted within long_tokens / ageing steps, then runs long_tokens steps
        assert finished_at is not None and finished_at <= long_tokens / ageing + long_tokens + 1


def test_step_trace_has_one_json_line_per_step(sjf_plugin, tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    llm = one_at_a_time()
    engine = llm.engine
    llm.generate([PROMPT, [6, 7]], params(3))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [json.loads(json.dumps(s.row(), default=str)) for s in engine.metrics.steps]
    assert len(lines) == len(steps) > 0
    for line, step in zip(lines, steps, strict=True):
        assert {k: line[k] for k in step} == step
        assert line["scheduler"]["waiting"] >= 0
    assert len({line["run"] for line in lines}) == 1


def test_scheduler_sjf_is_a_hydra_config_option(sjf_plugin):
    from hydra import compose, initialize_config_module
    from hydra.core.config_store import ConfigStore

    get_plugin_manager().register_configs(ConfigStore.instance())  # as the servelab CLI does
    with initialize_config_module("servelab.conf", version_base="1.3"):
        cfg = compose("config", overrides=["scheduler=sjf", "scheduler.ageing=0.25"])
    own = inspect.signature(ShortestJobFirst.__init__).parameters
    base = inspect.signature(SchedulingPolicy.__init__).parameters
    assert dict(cfg.scheduler) == {
        "name": "sjf",
        "predictor": own["predictor"].default,
        "ageing": 0.25,
        "admission": base["admission"].default,
        "order": base["order"].default,
    }
    engine = build_engine(
        {"model": cfg.model, "scheduler": cfg.scheduler, "engine": {"num_threads": 1}}
    )
    assert isinstance(engine.scheduler.policy, ShortestJobFirst)
    assert engine.scheduler.policy.ageing == 0.25


@pytest.mark.parametrize("options", [{"predictor": "oracle"}, {"ageing": -1}])
def test_bad_options_are_config_errors(sjf_plugin, options):
    from servelab.errors import ConfigError

    with pytest.raises(ConfigError, match="sjf scheduler"):
        one_at_a_time(**options)
