"""Choosing a KV tier: every conf/kv_tier/ file composes and builds an engine,
lists every option of its part, `none` attaches nothing, and a value a tier
cannot take (or a combination it cannot serve) is a ConfigError that says
what would work."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import servelab.conf
from servelab import LLM, ConfigError
from servelab.engine.build import build_engine
from servelab.lab.runner import RUNNER_NODES
from servelab.registry.options import describe_options
from servelab.registry.plugin_manager import lookup, registered

CONF = Path(servelab.conf.__file__).parent / "kv_tier"
SMALL_KV = [
    "engine.kv_cache_memory=8MiB",
    "engine.swap_space=1MiB",
    "allocator.prefix_caching=true",
]


def tiny(**kwargs) -> LLM:
    options = dict(model="tiny", max_model_len=64, kv_cache_memory="1MiB", swap_space="256KiB")
    options.update(kwargs)
    return LLM(**options)


PAGED = {"name": "paged", "block_size": 4, "prefix_caching": True}


@pytest.mark.parametrize("option", sorted(p.stem for p in CONF.glob("*.yaml")))
def test_every_kv_tier_config_composes_and_builds(option, tmp_path):
    assert option in registered("kv_tier")
    node = yaml.safe_load((CONF / f"{option}.yaml").read_text())
    accepted = describe_options(lookup("kv_tier", option), "kv_tier")
    assert set(node) - {"name"} == set(accepted), "the YAML file lists every option"
    overrides = [f"kv_tier={option}", *SMALL_KV]
    if "path" in accepted:
        overrides.append(f"kv_tier.path={tmp_path / 'blocks'}")
    with initialize_config_module(config_module="servelab.conf", version_base="1.3"):
        config = OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)
    engine = build_engine({k: v for k, v in config.items() if k not in RUNNER_NODES})
    assert engine.config["kv_tier"]["name"] == option
    if option == "none":
        assert engine.kv_tier is None and engine.allocator.tier_link is None
    else:
        assert engine.allocator.tier_link.tier is engine.kv_tier


def test_none_is_the_default():
    assert tiny().engine.kv_tier is None


@pytest.mark.parametrize(
    "tier,engine,message",
    [
        ({"name": "host", "policy": "write_around"}, {},
         "policy must be one of write_back, write_through, got 'write_around'"),
        ({"name": "host", "capacity_blocks": 4, "capacity_bytes": "1MiB"}, {},
         "set capacity_blocks or capacity_bytes, not both"),
        ({"name": "host", "capacity_blocks": 0}, {}, "capacity_blocks must be an integer >= 1"),
        ({"name": "host", "capacity_bytes": "1KiB"}, {}, "holds no block"),
        ({"name": "host", "capacity_bytes": "lots"}, {}, "cannot read 'lots' as a size"),
        ({"name": "host"}, {"swap_space": 0}, "raise engine.swap_space"),
        ({"name": "disk", "path": ""}, {}, "path must name a folder"),
        ({"name": "tiered", "path": "{tmp}", "policy": "lazy"}, {},
         "policy must be one of write_back, write_through"),
        ({"name": "disk", "path": "{tmp}/a-file"}, {}, "cannot make the folder"),
        ({"name": "host"}, {"allocator": {"name": "paged", "block_size": 4}},
         "set allocator.prefix_caching=true"),
        ({"name": "host"}, {"allocator": "contiguous"}, "prefix_caching"),
        ({"name": "bigger"}, {}, "host"),  # an unknown tier: the registry lists them
    ],
)  # fmt: skip
def test_bad_values_are_config_errors_naming_what_works(tmp_path, tier, engine, message):
    (tmp_path / "a-file").write_text("")
    tier = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in tier.items()}
    engine = {"allocator": PAGED, **engine}
    with pytest.raises(ConfigError, match=_escaped(message)):
        tiny(kv_tier=tier, **engine)


def test_a_tier_needs_an_executor_that_runs_its_copies(monkeypatch):
    from servelab.plugins.executors.model import ModelExecutor

    monkeypatch.setattr(ModelExecutor, "runs_tier_copies", False)
    with pytest.raises(ConfigError, match="does not run a KV tier's copies"):
        tiny(kv_tier="host", allocator=PAGED)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)
