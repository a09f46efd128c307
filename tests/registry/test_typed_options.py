"""Options are typed: a part's options by its constructor's annotations, the
engine's by `ENGINE_TYPES`. A wrong type or range is a ConfigError naming the
key, the value and what is accepted, before anything is built; a string is
never a truthy boolean. The shipped YAML defaults satisfy the same types."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import servelab.conf
from servelab import LLM
from servelab.engine.build import ENGINE_DEFAULTS, ENGINE_TYPES
from servelab.errors import ConfigError
from servelab.registry.options import check_option_types
from servelab.registry.plugin_manager import lookup
from servelab.registry.typed import type_problem

CONF = Path(servelab.conf.__file__).parent

BAD_ENGINE = [
    ({"compile": "maybe"}, "engine option compile must be true or false, got 'maybe'"),
    ({"compile": "no"}, "engine option compile must be true or false, got 'no'"),
    ({"compile": 1}, "engine option compile must be true or false, got 1"),
    ({"cuda_graphs": "yes"}, "engine option cuda_graphs must be true or false"),
    ({"max_num_batched_tokens": 0}, "engine option max_num_batched_tokens must be >= 1, got 0"),
    ({"num_threads": 0}, "engine option num_threads must be >= 1, got 0"),
    ({"num_threads": -2}, "engine option num_threads must be >= 1, got -2"),
    ({"max_num_seqs": 0}, "engine option max_num_seqs must be >= 1, got 0"),
    ({"max_model_len": 0}, "engine option max_model_len must be >= 1, got 0"),
    ({"max_num_seqs": "abc"}, "engine option max_num_seqs must be an integer, got 'abc'"),
    ({"max_num_seqs": 2.5}, "engine option max_num_seqs must be an integer, got 2.5"),
    ({"seed": "abc"}, "engine option seed must be an integer, got 'abc'"),
    ({"seed": 1.5}, "engine option seed must be an integer"),
    ({"kv_cache_memory": True}, "engine option kv_cache_memory must be an integer or a string"),
    ({"gpu_memory_utilization": "0.9"}, "engine option gpu_memory_utilization must be a finite number or null"),
    ({"dtype": 32}, "engine option dtype must be a string"),
]  # fmt: skip

BAD_PARTS = [
    ({"allocator": {"name": "paged", "prefix_caching": "false"}}, "allocator 'paged' option prefix_caching must be true or false, got 'false'"),
    ({"allocator": {"name": "paged", "block_size": 2.5}}, "allocator 'paged' option block_size must be an integer, got 2.5"),
    ({"allocator": {"name": "paged", "block_size": True}}, "option block_size must be an integer, got True"),
    ({"scheduler": {"name": "chunked", "chunk_size": True}}, "scheduler 'chunked' option chunk_size must be an integer, got True"),
    ({"scheduler": {"name": "chunked", "chunk_size": "8"}}, "option chunk_size must be an integer"),
    ({"scheduler": {"name": "static", "batch_timeout": "1"}}, "scheduler 'static' option batch_timeout must be a finite number"),
    ({"scheduler": {"name": "static", "batch_size": 1.5}}, "option batch_size must be an integer or null"),
]  # fmt: skip


@pytest.mark.parametrize(
    "engine,message",
    BAD_ENGINE,
    ids=[next(iter(e)) + "=" + repr(next(iter(e.values()))) for e, _ in BAD_ENGINE],
)
def test_a_mistyped_engine_option_is_refused_before_the_model_loads(engine, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        LLM(model="/no/such/model/so/a/late/check/would/say/so", **engine)


@pytest.mark.parametrize("parts,message", BAD_PARTS, ids=[str(p) for p, _ in BAD_PARTS])
def test_a_mistyped_part_option_is_refused(parts, message):
    with pytest.raises(ConfigError, match=message):
        LLM(model="tiny", **parts)


def test_the_engine_defaults_have_their_types():
    assert set(ENGINE_TYPES) == set(ENGINE_DEFAULTS)
    for key, value in ENGINE_DEFAULTS.items():
        assert type_problem(value, ENGINE_TYPES[key]) is None, key
    yaml_engine = yaml.safe_load((CONF / "config.yaml").read_text())["engine"]
    for key, value in yaml_engine.items():
        assert type_problem(value, ENGINE_TYPES[key]) is None, key


@pytest.mark.parametrize(
    "kind,path",
    [(p.parent.name, p) for k in ("scheduler", "allocator", "preemption", "attention") for p in sorted((CONF / k).glob("*.yaml"))],
    ids=lambda v: str(v) if isinstance(v, str) else v.stem,
)  # fmt: skip
def test_every_shipped_part_config_has_its_types(kind, path):
    node = yaml.safe_load(path.read_text())
    name = node.pop("name")
    check_option_types(lookup(kind, name), kind, name, node)  # raises on a mistyped default


def test_the_command_line_says_which_key_is_wrong(tmp_path):
    bin_dir = Path(sys.executable).parent
    done = subprocess.run(
        [str(bin_dir / "servelab"), "engine.compile=maybe", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert (
        "servelab: error: engine option compile must be true or false, got 'maybe'" in done.stderr
    )
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "node,message",
    [
        ({"run": {"progress": "no"}}, "run option progress must be true or false, got 'no'"),
        ({"run": {"warmup": 0}}, "run option warmup must be true or false, got 0"),
        ({"run": {"idle_sleep": -1}}, "run option idle_sleep must be >= 0 seconds"),
        ({"run": {"idle_sleep": "fast"}}, "run option idle_sleep must be a finite number"),
        ({"report": {"title": 3}}, "report option title must be a string or null, got 3"),
        ({"report": {"sort": 1}}, "report option sort must be a string, got 1"),
        ({"report": {"claims": "all"}}, "report option claims must be a list, got 'all'"),
    ],
)
def test_run_and_report_options_are_typed(node, message):
    from servelab.lab.report import report_options
    from servelab.lab.runner import run_options

    check = run_options if "run" in node else report_options
    with pytest.raises(ConfigError, match=message):
        check(next(iter(node.values())))


def test_an_int_too_large_for_a_float_is_a_clear_error():
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be a finite number or null"):
        LLM(model="/no/such/model", gpu_memory_utilization=10**400)
