"""Every config in conf/ composes with Hydra's compose API, and every valid
combination builds an engine (without running it). Every option of every
built-in part is in its YAML file, so it can be set on the command line; a
misspelt option is an error that lists the accepted ones."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from safetensors.torch import save_file

import servelab.conf
from servelab.engine.build import build_engine
from servelab.errors import ConfigError
from servelab.executor.device_memory import model_weight_bytes
from servelab.lab.report import report_options
from servelab.lab.runner import RUNNER_NODES, run_options
from servelab.lab.workload import WORKLOADS, make_workload
from servelab.model.config import ModelConfig, named_config
from servelab.model.transformer import Transformer
from servelab.registry.options import describe_options
from servelab.registry.plugin_manager import get_plugin_manager, lookup

CONF = Path(servelab.conf.__file__).parent
COMPONENTS = ("scheduler", "allocator", "preemption", "attention")
SMALL_KV = ["engine.kv_cache_memory=8MiB", "engine.swap_space=1MiB"]  # fast to allocate
BIG_MODELS = {"qwen3-0.6b"}  # random init of 0.6B parameters: built only when SERVELAB_SLOW=1
# shapes for the simulated executor, with the parameter counts their model cards state
SHAPE_ONLY = {"llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "qwen3-8b": 8.2e9, "qwen3-32b": 32.8e9}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(scope="module", autouse=True)
def hydra_context():
    with initialize_config_module(config_module="servelab.conf", version_base="1.3"):
        yield


def compose_plain(overrides: list[str]) -> dict:
    cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def engine_config(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in RUNNER_NODES}


def test_every_group_has_options_and_the_defaults_list_is_kept():
    groups = {"model", "scheduler", "allocator", "preemption", "attention", "workload", "device"}
    for group in groups | {"experiment"}:
        assert options(group), group
    config = compose_plain([])
    assert groups - {"device"} <= set(config) and {"engine", "run", "report"} <= set(config)
    assert options("model") == [
        "bench", "llama3-70b", "llama3-8b", "qwen3-0.6b", "qwen3-32b", "qwen3-8b",
        "tiny", "tiny-llama", "tiny-qwen2",
    ]  # fmt: skip
    assert options("executor") == ["model", "simulated"]
    assert options("hardware") == ["a100-80g", "cpu-local", "h100-sxm", "h100-sxm-fa3", "h200", "l40s", "rtx-pro-6000"]
    assert options("device") == ["cpu", "cuda"]


@pytest.mark.parametrize(
    ("group", "option"),
    [(g, o) for g in ("model", *COMPONENTS, "workload", "device") for o in options(g)],
)
def test_every_option_composes(group, option):
    config = compose_plain([f"{group}={option}"])
    if group == "device":
        assert config["engine"]["device"] == option
    elif group in COMPONENTS or group == "model":
        assert config[group]["name"] == option
    else:
        assert config["workload"]["name"] in WORKLOADS


@pytest.mark.parametrize("combo", list(itertools.product(*(options(c) for c in COMPONENTS))))
def test_every_component_combination_builds(combo):
    overrides = [f"{group}={option}" for group, option in zip(COMPONENTS, combo)]
    config = compose_plain(overrides + SMALL_KV)
    engine = build_engine(engine_config(config))
    for group, option in zip(COMPONENTS, combo):
        assert engine.config[group]["name"] == option
    assert engine.scheduler.max_num_seqs == config["engine"]["max_num_seqs"]


@pytest.mark.parametrize("model", options("model"))
def test_every_model_builds(model):
    if model in SHAPE_ONLY:  # no weights: the simulated executor reads the shape
        config = compose_plain(
            [f"model={model}", "executor=simulated", "engine.kv_cache_memory=4GiB"]
        )
        engine = build_engine(engine_config(config))
        params = model_weight_bytes(engine.model_config, "float32") / 4
        assert abs(params / SHAPE_ONLY[model] - 1) < 0.01, params
        return
    if model in BIG_MODELS and not os.environ.get("SERVELAB_SLOW"):
        # random init of 0.6B parameters takes ~15 s here: check the shape the
        # GPU benchmark relies on (the figures) instead of building it
        shape = named_config(compose_plain([f"model={model}"])["model"]["name"])
        assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads) == (
            28,
            1024,
            16,
            8,
        )
        assert (shape.head_dim, shape.intermediate_size, shape.vocab_size) == (128, 3072, 151936)
        assert shape.tie_word_embeddings and shape.qk_norm
        return
    kv = ["engine.kv_cache_memory=512MiB"] if model in BIG_MODELS else SMALL_KV
    config = compose_plain([f"model={model}", *kv])
    engine = build_engine(engine_config(config))
    assert engine.model_config.vocab_size > 0


def test_model_path_loads_a_checkpoint_folder(tmp_path):
    hf = dict(
        model_type="llama", vocab_size=48, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2,
    )  # fmt: skip
    model = Transformer(ModelConfig.from_hf_dict(hf), torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    tensors = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = compose_plain([f"model.path={tmp_path}", "engine.max_model_len=256", *SMALL_KV])
    engine = build_engine(engine_config(config))
    assert engine.model_config.vocab_size == 48


@pytest.mark.parametrize("device", options("device"))
def test_devices(device):
    config = engine_config(compose_plain([f"device={device}", *SMALL_KV]))
    if device == "cuda" and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            build_engine(config)
        return
    assert build_engine(config).executor.device.type == device


# a small file in each file-reading workload's published format (two requests each)
TRACE_FILES = {
    "trace": ("t.jsonl", '{"prompt_len": 4, "output_len": 2}\n{"prompt_len": 6, "output_len": 3}\n'),
    "burstgpt": ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,12,3,15,Conversation log\n7,GPT-4,9,4,13,API log\n"),
    "azure_llm": ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                  "2023-11-16 18:15:46.6805900,12,3\n2023-11-16 18:15:47.0000000,9,4\n"),
    "mooncake": ("m.jsonl", '{"timestamp": 0, "input_length": 12, "output_length": 3, "hash_ids": [0]}\n'
                 '{"timestamp": 20, "input_length": 9, "output_length": 4, "hash_ids": [0]}\n'),
    "sharegpt": ("s.json", '[{"id": "a", "conversations": [{"from": "human", "value": "hi there"}, '
                 '{"from": "gpt", "value": "hello to you"}]}, {"id": "b", "conversations": '
                 '[{"from": "human", "value": "why?"}, {"from": "gpt", "value": "because"}]}]'),
}  # fmt: skip


# the trained pair's workloads are trace files (written by benchmarks/spec_pair.py)
TRACE_FILES["spec_pair_code_completion"] = TRACE_FILES["spec_pair_code_edit"] = TRACE_FILES["trace"]


def trace_overrides(workload: str, folder) -> list[str]:
    if workload not in TRACE_FILES:
        return []
    name, text = TRACE_FILES[workload]
    (folder / name).write_text(text)
    return [f"workload.path={folder / name}"]


@pytest.mark.parametrize("workload", options("workload"))
def test_every_workload_makes_requests(workload, tmp_path):
    overrides = [f"workload={workload}", *trace_overrides(workload, tmp_path)]
    config = compose_plain(overrides)
    requests = make_workload(config["workload"], vocab_size=512, max_model_len=1024)
    assert requests and all(r.prompt_token_ids and r.params.max_tokens >= 1 for r in requests)


def sweep_jobs(preset: str) -> list[list[str]]:
    """The override lists of a preset's multirun (the product of its sweeper params)."""
    cfg = compose(
        config_name="config", overrides=[f"experiment={preset}"], return_hydra_config=True
    )
    params = cfg.hydra.sweeper.params
    params = OmegaConf.to_container(params, resolve=True) if params is not None else {}
    parser = OverridesParser.create()
    axes = [
        [f"{key}={value}" for value in override.sweep_string_iterator()]
        for key, values in params.items()
        if key != "run.repeat"  # every configuration's repeats: run.repeats, 1 unless set
        for override in parser.parse_overrides([f"{key}={values}"])
    ]
    return [list(job) for job in itertools.product(*axes)]


@pytest.fixture
def a_trained_pair(tmp_path, monkeypatch):
    """$HOME with a seconds-long trained pair where the `speculative_decoding`
    preset looks for one (~/.cache/servelab/spec_pair/latest); the CPU kernels'
    cache stays where it was."""
    from tests.benchmark_scripts import quick_pair_home

    for name, value in quick_pair_home(tmp_path / "home").items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("preset", options("experiment"))
def test_every_preset_job_composes_and_builds(preset, tmp_path, request):
    if preset == "speculative_decoding":  # the trained pair's model and workloads
        request.getfixturevalue("a_trained_pair")
    jobs = sweep_jobs(preset)
    if preset == "reference":
        assert jobs == [[]]  # one run, not a sweep
    else:
        assert len(jobs) >= 2, f"{preset} is a multirun preset"
    for job in jobs:
        # a preset may put a disk tier's folder in its run's output folder (`${hydra:...}`),
        # which only a Hydra run resolves: here a folder of the test's stands in
        job = [*job, f"run.kv_tier_folder={tmp_path / 'kv_blocks'}"]
        config = compose_plain([f"experiment={preset}", *job])
        if config["workload"].get("path", "") is None:  # a public-trace preset: a small file
            config = compose_plain([f"experiment={preset}", *job,
                                    *trace_overrides(config["workload"]["name"], tmp_path)])  # fmt: skip
        if config["model"]["name"] in BIG_MODELS and not os.environ.get("SERVELAB_SLOW"):
            continue
        engine = build_engine(engine_config(config))
        requests = make_workload(
            config["workload"], engine.model_config.vocab_size, engine.max_model_len
        )
        assert requests
        assert config["report"]["title"] or preset == "reference"


def test_reference_preset_is_the_benchmark_workload():
    config = compose_plain(["experiment=reference"])
    assert config["model"]["name"] == "bench" and config["engine"]["num_threads"] == 2
    requests = make_workload(config["workload"], vocab_size=1024)
    assert len(requests) == 64 and all(r.arrival_time == 0 for r in requests)
    assert all(32 <= len(r.prompt_token_ids) <= 256 for r in requests)
    assert all(16 <= r.params.max_tokens <= 256 for r in requests)
    assert all(r.params.greedy and r.params.ignore_eos for r in requests)


@pytest.mark.parametrize("kind", COMPONENTS)
def test_every_builtin_option_is_in_its_yaml(kind):
    get_plugin_manager()
    for path in (CONF / kind).glob("*.yaml"):
        node = yaml.safe_load(path.read_text())
        cls = lookup(kind, node["name"])
        assert set(node) - {"name"} == set(describe_options(cls, kind)), path.name


def test_a_misspelt_option_is_an_error_listing_the_accepted_ones():
    # without `+`, Hydra itself refuses a key the config does not have
    with pytest.raises(ConfigCompositionException):
        compose_plain(["scheduler=chunked", "scheduler.chunk_sise=8"])
    # with `+`, it reaches build_engine, which lists the accepted options
    config = compose_plain(["scheduler=chunked", "+scheduler.chunk_sise=8"])
    with pytest.raises(ConfigError) as err:
        build_engine(engine_config(config))
    assert "'chunk_sise'" in str(err.value) and "chunk_size" in str(err.value)
    config = compose_plain(["+workload.num_request=3"])
    with pytest.raises(ConfigError, match="accepted: seed, repeat, scale"):
        make_workload(config["workload"], vocab_size=512)
    with pytest.raises(
        ConfigError, match="accepted: idle_sleep, kv_tier_folder, progress, repeat, repeats, warmup"
    ):
        run_options({"progres": False})
    with pytest.raises(ConfigError, match="accepted: title, sort, figures, claims"):
        report_options({"claim": []})
    config = compose_plain(["+engine.max_num_seq=3"])
    with pytest.raises(ConfigError, match="unknown engine option 'max_num_seq'"):
        build_engine(engine_config(config))


def test_a_misspelt_preset_is_an_error_listing_the_presets():
    """The experiment group is not optional: an unknown preset never runs the default."""
    with pytest.raises(
        MissingConfigException, match="Could not find 'experiment/load_curv'"
    ) as err:
        compose_plain(["experiment=load_curv"])
    presets = sorted(
        p.stem for p in (Path(servelab.conf.__file__).parent / "experiment").glob("*.yaml")
    )
    assert presets and all(f"\t{name}\n" in str(err.value) for name in presets)
    assert "experiment" not in compose_plain([])  # no preset: nothing merged
