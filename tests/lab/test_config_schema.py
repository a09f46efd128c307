"""The typed `engine`, `run` and `report` nodes: Hydra composes every config onto
the structured schema, so a wrong type or an unknown key stops composition with
one message naming the key, the value and what it accepts."""

from __future__ import annotations

import dataclasses

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from servelab.engine.build import ENGINE_DEFAULTS
from servelab.lab.config_schema import (
    EngineSchema,
    ReportSchema,
    RunSchema,
    composition_message,
)
from servelab.lab.report import REPORT_DEFAULTS, report_options
from servelab.lab.runner import RUN_DEFAULTS


@pytest.fixture(scope="module", autouse=True)
def hydra_context():
    with initialize_config_module(config_module="servelab.conf", version_base="1.3"):
        yield


def composed(*overrides: str) -> dict:
    return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)


def refusal(*overrides: str) -> str:
    with pytest.raises((HydraException, OmegaConfBaseException)) as caught:
        compose("config", overrides=list(overrides))
    return composition_message(caught.value)


def test_the_schema_is_in_the_config_store_and_made_from_the_python_tables():
    config = compose("config")
    assert OmegaConf.get_type(config.engine) is EngineSchema
    assert OmegaConf.get_type(config.run) is RunSchema
    for schema, defaults in (
        (EngineSchema, ENGINE_DEFAULTS),
        (RunSchema, RUN_DEFAULTS),
        (ReportSchema, REPORT_DEFAULTS),
    ):
        fields = {f.name: f for f in dataclasses.fields(schema)}
        assert list(fields) == list(defaults)
        assert dataclasses.asdict(schema()) == defaults


def test_the_composed_defaults_equal_the_python_defaults():
    config = composed()
    device_keys = {"device", "dtype", "num_threads"}  # the device group sets these
    engine = {k: v for k, v in config["engine"].items() if k not in device_keys}
    assert engine == {k: v for k, v in ENGINE_DEFAULTS.items() if k not in device_keys}
    assert config["run"] == RUN_DEFAULTS
    assert config["report"] == REPORT_DEFAULTS


@pytest.mark.parametrize(
    "override, message",
    [
        ("engine.compile=maybe", "engine option compile must be true or false, got 'maybe'"),
        ("engine.cuda_graphs=often", "option cuda_graphs must be true or false, got 'often'"),
        ("engine.max_num_seqs=abc", "engine option max_num_seqs must be an integer, got 'abc'"),
        ("engine.max_num_seqs=2.5", "engine option max_num_seqs must be an integer, got 2.5"),
        ("engine.seed=true", "engine option seed must be an integer, got True"),
        ("engine.max_num_batched_tokens=x", "must be an integer or null, got 'x'"),
        ("engine.gpu_memory_utilization=half", "must be a finite number or null, got 'half'"),
        ("run.warmup=2.5", "run option warmup must be true or false, got 2.5"),
        ("run.idle_sleep=soon", "run option idle_sleep must be a finite number, got 'soon'"),
        ("report.figures=3", "report option figures must be a list, got 3"),
        ("engine.bogus=1", "unknown engine option 'bogus'; accepted: compile, cpu_kernels"),
        (
            "run.bogus=1",
            "unknown run option 'bogus'; accepted: idle_sleep, kv_tier_folder, progress, repeat, repeats, warmup",
        ),
        (
            "report.colour=red",
            "unknown report option 'colour'; accepted: after_sweep, claims, dpi, figures",
        ),
        ("experiment=load_curv", "Could not find 'experiment/load_curv'"),
        ("scheduler=nope", "Available options in 'scheduler': chunked continuous"),
    ],
)
def test_a_wrong_type_or_key_is_refused_while_composing(override, message):
    assert message in refusal(override)


def test_yaml_booleans_are_booleans_never_truthy_strings():
    # OmegaConf reads YAML 1.1's spellings of a boolean as that boolean
    assert composed("engine.compile=no")["engine"]["compile"] is False
    assert composed("engine.compile=false")["engine"]["compile"] is False
    assert composed("engine.cuda_graphs=on")["engine"]["cuda_graphs"] is True


def test_a_sized_option_keeps_both_spellings():
    assert composed("engine.kv_cache_memory=8MiB")["engine"]["kv_cache_memory"] == "8MiB"
    assert composed("engine.kv_cache_memory=1048576")["engine"]["kv_cache_memory"] == 1048576


@pytest.mark.parametrize(
    "overrides",
    [
        ["report.slo={ttft_ms: 200, tpot_ms: 50}"],
        ["++report.slo={ttft_ms: 200, tpot_ms: 50}"],
        ["report.slo.ttft_ms=200", "report.slo.tpot_ms=50"],
        ["experiment=load_curve", "report.slo.ttft_ms=200", "report.slo.tpot_ms=50"],
    ],
)
def test_report_slo_is_set_from_the_command_line_in_every_spelling(overrides):
    slo = report_options(composed(*overrides)["report"])["slo"]
    assert slo == {"ttft_ms": 200, "tpot_ms": 50, "percentile": 90}


def test_no_slo_by_default_and_a_misspelt_slo_key_lists_the_valid_ones():
    assert report_options(composed()["report"])["slo"] is None
    assert report_options(composed("report.slo=null")["report"])["slo"] is None
    assert "unknown report.slo option 'ttft'; accepted: itl_ms, percentile, tpot_ms, ttft_ms" in (
        refusal("report.slo.ttft=200")
    )
    assert "report.slo option ttft_ms must be a finite number or null, got 'soon'" in refusal(
        "report.slo.ttft_ms=soon"
    )


def test_a_failure_silent_at_the_top_is_named_by_its_first_cause_that_says_something():
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import GrammarParseError

    outer = ConfigCompositionException("")
    outer.__cause__ = GrammarParseError("token recognition error at: '~'")
    assert composition_message(outer) == "token recognition error at: '~'"
    assert composition_message(ConfigCompositionException("")) == "ConfigCompositionException"


@pytest.mark.parametrize("tier", ["disk", "tiered"])
def test_a_disk_tier_keeps_its_blocks_where_run_kv_tier_folder_says(tier):
    assert composed(f"kv_tier={tier}")["kv_tier"]["path"] == "~/.cache/servelab/kv_blocks"
    moved = composed(f"kv_tier={tier}", "run.kv_tier_folder=/runs/7/kv_blocks")
    assert moved["kv_tier"]["path"] == "/runs/7/kv_blocks"
