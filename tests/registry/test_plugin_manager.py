"""The plugin manager against fake distributions (tests/registry/fake_dists/).

Each fake distribution is a folder holding a package and its `*.dist-info`;
putting the folder on `sys.path` is all it takes for `importlib.metadata` to
see its entry points. Built-ins are replaced by fakes so the tests do not
depend on the real built-in plugins.
"""

from __future__ import annotations

import email.parser
import importlib
import inspect
import logging
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from servelab import hookimpl
from servelab.contracts.allocator import KVAllocator
from servelab.contracts.attention import AttentionBackend
from servelab.contracts.kinds import KINDS
from servelab.contracts.preemption import PreemptionPolicy
from servelab.contracts.scheduler import SchedulingPolicy
from servelab.errors import ConfigError
from servelab.registry import plugin_manager
from servelab.registry.construct import construct
from servelab.registry.options import REQUIRED, describe_options, split_component

FAKE_DISTS = Path(__file__).parent / "fake_dists"
FAKE_PREFIX = "servelab_fake"
REAL_DEFAULT_PLUGINS = plugin_manager.DEFAULT_PLUGINS
ATTENTION_CONTEXT = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "scale": 0.125}


@pytest.fixture(autouse=True)
def isolated_manager(monkeypatch):
    """A fresh manager per test: fake built-ins only, nothing disabled, fake modules forgotten."""
    monkeypatch.setattr(plugin_manager, "DEFAULT_PLUGINS", ())
    monkeypatch.delenv(plugin_manager.DISABLE_ENV, raising=False)
    monkeypatch.syspath_prepend(str(FAKE_DISTS / "builtins"))
    plugin_manager.reset_plugin_manager()
    yield
    plugin_manager.reset_plugin_manager()
    for name in [m for m in sys.modules if m.startswith(FAKE_PREFIX)]:
        del sys.modules[name]


def install(monkeypatch, *folders: str) -> None:
    """Puts fake distributions on sys.path, as `pip install` would."""
    for folder in folders:
        monkeypatch.syspath_prepend(str(FAKE_DISTS / folder))


def dist_label(folder: str) -> str:
    """`"<Name> <Version>"` read from the fake distribution's METADATA file."""
    (metadata_file,) = (FAKE_DISTS / folder).glob("*.dist-info/METADATA")
    metadata = email.parser.Parser().parsestr(metadata_file.read_text())
    return f"{metadata['Name']} {metadata['Version']}"


def entry_point_name(folder: str) -> str:
    (entry_points,) = (FAKE_DISTS / folder).glob("*.dist-info/entry_points.txt")
    line = [ln for ln in entry_points.read_text().splitlines() if "=" in ln][0]
    return line.split("=")[0].strip()


def use_fake_builtins(monkeypatch, *modules: str) -> None:
    monkeypatch.setattr(plugin_manager, "DEFAULT_PLUGINS", modules)


def records_mentioning(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


# -- loading


def test_entry_point_plugin_is_registered_with_its_distribution(monkeypatch):
    install(monkeypatch, "sjf")
    schedulers = plugin_manager.registered("scheduler")
    plugin = importlib.import_module("servelab_fake_sjf.plugin")

    info = schedulers["fake_sjf"]
    assert info.cls is plugin.ShortestJobFirst
    assert info.origin == dist_label("sjf")
    assert info.plugin == entry_point_name("sjf")
    assert info.description == plugin.ShortestJobFirst.__doc__.splitlines()[0]
    assert plugin_manager.lookup("scheduler", "fake_sjf") is plugin.ShortestJobFirst
    assert plugin_manager.lookup("attention", "fake_window") is plugin.SlidingWindowAttention


def test_builtin_plugin_is_registered_as_builtin(monkeypatch):
    use_fake_builtins(monkeypatch, "servelab_fake_builtin")
    info = plugin_manager.registered("preemption")["fake_lifo"]
    assert info.cls is importlib.import_module("servelab_fake_builtin").LastInFirstOut
    assert info.origin == plugin_manager.BUILTIN


def test_part_options_exclude_engine_context(monkeypatch):
    install(monkeypatch, "sjf")
    plugin = importlib.import_module("servelab_fake_sjf.plugin")
    # The fakes take their context as keyword-only parameters without defaults
    # (or through **context), so their user options are exactly the kwdefaults.
    window = plugin.SlidingWindowAttention
    assert plugin_manager.registered("attention")["fake_window"].options == (
        window.__init__.__kwdefaults__
    )
    # a scheduling policy has no engine context; its options include the base's
    base = {
        name: p.default
        for name, p in inspect.signature(SchedulingPolicy.__init__).parameters.items()
        if name != "self"
    }
    sjf = plugin.ShortestJobFirst
    assert plugin_manager.registered("scheduler")["fake_sjf"].options == {
        **sjf.__init__.__kwdefaults__,
        **base,
    }


@pytest.mark.parametrize("by", ["entry point", "module"])
def test_disabled_plugin_is_not_loaded(monkeypatch, by):
    install(monkeypatch, "sjf")
    module = "servelab_fake_sjf.plugin"
    blocked = entry_point_name("sjf") if by == "entry point" else module
    monkeypatch.setenv(plugin_manager.DISABLE_ENV, f"something_else, {blocked}")

    assert "fake_sjf" not in plugin_manager.registered("scheduler")
    assert module not in sys.modules  # never even imported
    with pytest.raises(ConfigError, match="unknown scheduler 'fake_sjf'"):
        plugin_manager.lookup("scheduler", "fake_sjf")


def test_disabled_builtin_is_not_loaded(monkeypatch):
    use_fake_builtins(monkeypatch, "servelab_fake_builtin")
    monkeypatch.setenv(plugin_manager.DISABLE_ENV, "servelab_fake_builtin")
    assert "fake_lifo" not in plugin_manager.registered("preemption")


def test_plugin_failing_to_import_is_reported_once_and_the_rest_load(monkeypatch, caplog):
    install(monkeypatch, "broken", "sjf")
    use_fake_builtins(monkeypatch, "servelab_fake_builtin")
    caplog.set_level(logging.WARNING, logger=plugin_manager.__name__)

    pm = plugin_manager.get_plugin_manager()
    for _ in range(3):  # repeated queries must not report again
        assert "fake_sjf" in plugin_manager.registered("scheduler")
        assert "fake_lifo" in plugin_manager.registered("preemption")

    name = entry_point_name("broken")
    (error,) = [e for e in pm.load_errors if e.plugin == name]
    assert error.origin == dist_label("broken")
    assert isinstance(error.error, ModuleNotFoundError)
    (record,) = records_mentioning(caplog, name)
    assert record.levelno == logging.WARNING
    assert dist_label("broken") in record.getMessage()
    assert "servelab_fake_missing_dependency" in record.getMessage()
    # A user asking for a part of the broken plugin learns why it is missing.
    with pytest.raises(ConfigError, match=dist_label("broken")):
        plugin_manager.lookup("scheduler", "from_the_broken_plugin")


def test_builtin_failing_to_import_is_an_error_and_the_rest_load(monkeypatch, caplog):
    use_fake_builtins(
        monkeypatch, "servelab_fake_builtin_that_does_not_exist", "servelab_fake_builtin"
    )
    caplog.set_level(logging.WARNING, logger=plugin_manager.__name__)

    assert "fake_lifo" in plugin_manager.registered("preemption")
    pm = plugin_manager.get_plugin_manager()
    assert [(e.plugin, e.origin) for e in pm.load_errors] == [
        ("servelab_fake_builtin_that_does_not_exist", plugin_manager.BUILTIN)
    ]
    (record,) = records_mentioning(caplog, "servelab_fake_builtin_that_does_not_exist")
    assert record.levelno == logging.ERROR


def test_raising_registration_hook_is_reported_once_and_the_rest_load(monkeypatch, caplog):
    install(monkeypatch, "sjf")
    caplog.set_level(logging.WARNING, logger=plugin_manager.__name__)

    class Crashing:
        @hookimpl
        def servelab_register_schedulers(self):
            raise RuntimeError("cannot register")

    pm = plugin_manager.get_plugin_manager()
    pm.register(Crashing(), name="crashing")
    assert "fake_sjf" in plugin_manager.registered("scheduler")
    pm.register(ConcretePolicy, name="unrelated")  # clears the collected parts: collect again
    assert "fake_sjf" in plugin_manager.registered("scheduler")

    assert [e.plugin for e in pm.load_errors] == ["crashing"]
    assert len(records_mentioning(caplog, "cannot register")) == 1


def test_misspelled_hook_disables_only_that_plugin(monkeypatch, caplog):
    install(monkeypatch, "typo", "sjf")
    caplog.set_level(logging.WARNING, logger=plugin_manager.__name__)
    pm = plugin_manager.get_plugin_manager()
    assert pm.get_plugin(entry_point_name("typo")) is None  # disabled
    assert "fake_sjf" in plugin_manager.registered("scheduler")  # the rest load
    (record,) = records_mentioning(caplog, "servelab_register_schedulerz")
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert entry_point_name("typo") in message and dist_label("typo") in message
    assert "servelab_register_schedulers" in message  # the known hooks are listed


# -- part rules


def test_duplicate_name_keeps_the_first_owner_and_warns_naming_both(monkeypatch, caplog):
    install(monkeypatch, "sjf", "dup")
    caplog.set_level(logging.WARNING, logger=plugin_manager.__name__)
    first = plugin_manager.registered("scheduler")["fake_sjf"]
    plugin_manager.registered("scheduler")  # collected again: still one warning
    (record,) = records_mentioning(caplog, "is registered twice")
    message = record.getMessage()
    assert "'fake_sjf'" in message and "the first keeps the name" in message
    for folder in ("sjf", "dup"):
        assert f"{entry_point_name(folder)} ({dist_label(folder)})" in message
    assert first.plugin in message.split("registered twice: by ", 1)[1].split(" and by")[0]


def test_a_third_party_part_never_shadows_a_builtin(monkeypatch, caplog):
    use_fake_builtins(monkeypatch, "servelab_fake_builtin")
    caplog.set_level(logging.WARNING, logger=plugin_manager.__name__)
    builtin = plugin_manager.lookup("preemption", "fake_lifo")

    class Shadow:
        @hookimpl(trylast=True)  # trylast puts its implementation first in pluggy's list
        def servelab_register_preemption_policies(self):
            return {"fake_lifo": ConcretePolicy}

    plugin_manager.get_plugin_manager().register(Shadow(), name="shadow", origin="shadow-dist 1.0")
    assert plugin_manager.lookup("preemption", "fake_lifo") is builtin
    (record,) = records_mentioning(caplog, "is registered twice")
    assert "shadow (shadow-dist 1.0)" in record.getMessage()


def test_same_name_in_two_kinds_is_allowed():
    class Plugin:
        @hookimpl
        def servelab_register_preemption_policies(self):
            return {"shared_name": ConcretePolicy}

        @hookimpl
        def servelab_register_attention_backends(self):
            return {"shared_name": ConcreteAttention}

    plugin_manager.get_plugin_manager().register(Plugin())
    assert plugin_manager.lookup("preemption", "shared_name") is ConcretePolicy
    assert plugin_manager.lookup("attention", "shared_name") is ConcreteAttention


def test_class_missing_abstract_methods_is_left_out_with_a_warning(monkeypatch, caplog):
    install(monkeypatch, "incomplete", "sjf")
    caplog.set_level(logging.WARNING, logger=plugin_manager.__name__)
    assert "fake_half" not in plugin_manager.registered("allocator")
    assert "fake_sjf" in plugin_manager.registered("scheduler")
    half = importlib.import_module("servelab_fake_incomplete.plugin").HalfAllocator
    implemented = set(vars(half))
    missing = sorted(m for m in KVAllocator.__abstractmethods__ if m not in implemented)
    assert missing  # the fixture really leaves some out
    (record,) = records_mentioning(caplog, "HalfAllocator")
    message = record.getMessage()
    assert dist_label("incomplete") in message and ", ".join(missing) in message
    with pytest.raises(
        ConfigError, match="unknown allocator 'fake_half'.*failed to load.*HalfAllocator"
    ):
        plugin_manager.lookup("allocator", "fake_half")


def test_class_outside_the_contract_is_left_out_with_a_warning(caplog):
    class NotAPolicy:
        pass

    class Plugin:
        @hookimpl
        def servelab_register_preemption_policies(self):
            return {"impostor": NotAPolicy, "fine": ConcretePolicy}

    caplog.set_level(logging.WARNING, logger=plugin_manager.__name__)
    plugin_manager.get_plugin_manager().register(Plugin(), name="impostor_plugin")
    policies = plugin_manager.registered("preemption")
    assert "impostor" not in policies and "fine" in policies  # the plugin's other part stays
    (record,) = records_mentioning(caplog, "impostor_plugin")
    assert "servelab.contracts.preemption.PreemptionPolicy" in record.getMessage()


def test_a_raising_register_configs_disables_its_plugin(caplog):
    from hydra.core.config_store import ConfigStore

    class Plugin:
        @hookimpl
        def servelab_register_configs(self, store):
            raise ValueError("no such group")

        @hookimpl
        def servelab_register_preemption_policies(self):
            return {"configless": ConcretePolicy}

    caplog.set_level(logging.WARNING, logger=plugin_manager.__name__)
    pm = plugin_manager.get_plugin_manager()
    pm.register(Plugin(), name="configless_plugin", origin="configless 0.1")
    pm.register_configs(ConfigStore.instance())
    assert "configless" not in plugin_manager.registered("preemption")
    (record,) = records_mentioning(caplog, "no such group")
    assert "configless_plugin (configless 0.1)" in record.getMessage()


def test_unknown_name_lists_registered_names(monkeypatch):
    install(monkeypatch, "sjf")
    names = sorted(plugin_manager.registered("scheduler"))
    assert "fake_sjf" in names
    with pytest.raises(ConfigError) as raised:
        plugin_manager.lookup("scheduler", "nope")
    assert str(raised.value).startswith(f"unknown scheduler 'nope'; registered: {', '.join(names)}")


def test_unknown_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown kind 'schedulers'"):
        plugin_manager.registered("schedulers")


# -- events


def test_raising_observer_is_reported_and_the_others_still_run(monkeypatch, caplog):
    install(monkeypatch, "noisy", "sjf")
    use_fake_builtins(monkeypatch, "servelab_fake_builtin")
    caplog.set_level(logging.ERROR, logger=plugin_manager.__name__)
    pm = plugin_manager.get_plugin_manager()
    calls: list[str] = []

    class LastRegistered:  # pluggy calls the last registered first
        @hookimpl
        def servelab_step_end(self, engine, step):
            calls.append("runtime")

    pm.register(LastRegistered())
    steps = [{"step": 0}, {"step": 1}]
    for step in steps:
        plugin_manager.notify("servelab_step_end", engine=None, step=step)

    assert calls == ["runtime", "runtime"]
    assert importlib.import_module("servelab_fake_builtin").STEPS_SEEN == steps
    assert importlib.import_module("servelab_fake_sjf.plugin").STEPS_SEEN == steps
    noisy = entry_point_name("noisy")
    failure = pm.hook_failures[("servelab_step_end", noisy)]
    assert failure.count == len(steps)
    assert type(failure.first_error).__name__ == "ObserverBroke"
    assert len(records_mentioning(caplog, noisy)) == 1  # logged once, then counted


def test_notify_rejects_wrong_arguments():
    with pytest.raises(TypeError, match="step"):
        plugin_manager.notify("servelab_step_end", engine=None)
    with pytest.raises(ValueError, match="not an event hook"):
        plugin_manager.notify("servelab_register_schedulers")


def test_register_configs_passes_the_store():
    stored = []

    class Plugin:
        @hookimpl
        def servelab_register_configs(self, store):
            store.store(group="scheduler", name="mine", node={"name": "mine"})

    class RecordingStore:
        def store(self, **kwargs):
            stored.append(kwargs)

    pm = plugin_manager.get_plugin_manager()
    pm.register(Plugin())
    pm.register_configs(RecordingStore())
    assert stored == [{"group": "scheduler", "name": "mine", "node": {"name": "mine"}}]


# -- options


class ConcretePolicy(PreemptionPolicy):
    def preempt(self, group, allocator):
        return "waiting"


class NeedsBudget(ConcretePolicy):
    def __init__(self, budget: int, patience: float = 1.5):
        self.budget, self.patience = budget, patience


class ConcreteAttention(AttentionBackend):
    def __init__(self, *, depth: int = 2, **context):
        super().__init__(**context)
        self.depth = depth

    def plan(self, meta):
        return None

    def forward(self, q, k, v, kv_cache, plan):
        raise NotImplementedError


class WiderAttention(ConcreteAttention):
    def __init__(self, width: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.width = width


def test_split_component_forms():
    assert split_component("paged") == ("paged", {})
    assert split_component({"name": "paged", "block_size": 8}) == ("paged", {"block_size": 8})
    node = OmegaConf.create({"name": "paged", "size": "${.block}", "block": 4})
    assert split_component(node) == ("paged", {"size": 4, "block": 4})
    with pytest.raises(ConfigError, match="needs a 'name'; got keys: block_size"):
        split_component({"block_size": 8}, "allocator")


def test_describe_options_follows_kwargs_up_the_mro():
    assert describe_options(ConcreteAttention, "attention") == {"depth": 2}
    assert describe_options(WiderAttention, "attention") == {"width": 3, "depth": 2}
    assert describe_options(NeedsBudget, "preemption") == {"budget": REQUIRED, "patience": 1.5}
    assert describe_options(ConcretePolicy, "preemption") == {}


def test_construct_builds_with_options_and_context(monkeypatch):
    install(monkeypatch, "sjf")
    spec = OmegaConf.create({"name": "fake_window", "window": 64})
    backend = construct("attention", spec, **ATTENTION_CONTEXT)
    assert type(backend).__name__ == "SlidingWindowAttention"
    assert (backend.window, backend.num_heads, backend.scale) == (64, 4, 0.125)
    assert backend.sink_tokens == backend.__init__.__kwdefaults__["sink_tokens"]


def test_unknown_option_lists_accepted_ones(monkeypatch):
    install(monkeypatch, "sjf")
    accepted = importlib.import_module("servelab_fake_sjf.plugin").SlidingWindowAttention
    accepted_names = ", ".join(accepted.__init__.__kwdefaults__)
    with pytest.raises(ConfigError) as raised:
        construct("attention", {"name": "fake_window", "windw": 3}, **ATTENTION_CONTEXT)
    assert str(raised.value) == (
        f"unknown option 'windw' for attention 'fake_window'; accepted: {accepted_names}"
    )


def test_engine_context_is_not_a_user_option(monkeypatch):
    install(monkeypatch, "sjf")
    with pytest.raises(ConfigError, match="num_heads is supplied by the engine"):
        construct("attention", {"name": "fake_window", "num_heads": 3}, **ATTENTION_CONTEXT)


def test_missing_required_option_is_named():
    class Plugin:
        @hookimpl
        def servelab_register_preemption_policies(self):
            return {"needs_budget": NeedsBudget}

    plugin_manager.get_plugin_manager().register(Plugin())
    with pytest.raises(ConfigError, match="preemption 'needs_budget' needs option 'budget'"):
        construct("preemption", "needs_budget")
    assert construct("preemption", {"name": "needs_budget", "budget": 7}).budget == 7


def test_context_outside_the_kinds_table_is_an_engine_bug():
    with pytest.raises(TypeError, match=r"KINDS\['preemption'\]\.context"):
        construct("preemption", "anything", num_blocks=3)


# -- the real built-ins


def test_every_builtin_plugin_loads():
    """Every module of the real DEFAULT_PLUGINS imports and registers without error."""
    pm = plugin_manager.build_plugin_manager(REAL_DEFAULT_PLUGINS)
    failed = [str(e) for e in pm.load_errors if e.origin == plugin_manager.BUILTIN]
    assert failed == []
    for kind in KINDS:
        for info in pm.registered(kind).values():  # contracts and names are checked here
            # `scheduler=<name>` alone must build: every context parameter is in its kind's context.
            required = [key for key, default in info.options.items() if default is REQUIRED]
            assert required == [], f"{kind} {info.name!r} requires {required}"
