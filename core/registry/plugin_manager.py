"""The plugin manager: loads plugins and looks parts up by name (errors list the known names).

Rules:
- built-ins are the modules of `DEFAULT_PLUGINS`, third-party ones the `servelab` entry points;
  `SERVELAB_DISABLE_PLUGINS=a,b` (entry-point or module names) keeps plugins unimported;
- a plugin that fails to import is reported once, with its distribution, and skipped; the
  rest still loads (a failing built-in is logged as an error: it is a servelab bug);
- a broken plugin hurts only itself: a misspelled hook or a raising
  `servelab_register_configs` disables the plugin, a part breaking its contract or
  reusing a taken name is left out, each with one warning naming its distribution; a
  built-in's name is never shadowed (the first owner keeps a name);
- an event-hook implementation that raises is reported and skipped; the engine goes on.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from servelab.contracts import hookspecs
from servelab.contracts.kinds import KINDS
from servelab.contracts.kinds import kind as get_kind
from servelab.errors import ConfigError, PluginError
from servelab.registry.parts import PartInfo, part_info

logger = logging.getLogger(__name__)

DEFAULT_PLUGINS: tuple[str, ...] = (
    "servelab.plugins.schedulers.static",
    "servelab.plugins.schedulers.continuous",
    "servelab.plugins.schedulers.chunked",
    "servelab.plugins.schedulers.vtc",
    "servelab.plugins.schedulers.mlfq",
    "servelab.plugins.allocators.paged",
    "servelab.plugins.allocators.contiguous",
    "servelab.plugins.allocators.radix",
    "servelab.plugins.preemption.recompute",
    "servelab.plugins.preemption.swap",
    "servelab.plugins.preemption.hybrid",
    "servelab.plugins.attention.padded",
    "servelab.plugins.attention.per_request",
    "servelab.plugins.attention.flash_varlen",
    "servelab.plugins.attention.triton_paged",
    "servelab.plugins.executors.model",
    "servelab.plugins.executors.simulated",
    "servelab.plugins.proposers.none",
    "servelab.plugins.proposers.ngram",
    "servelab.plugins.proposers.draft",
    "servelab.plugins.proposers.eagle",
    "servelab.plugins.proposers.simulated",
    "servelab.plugins.kv_tiers.none",
    "servelab.plugins.kv_tiers.host",
    "servelab.plugins.kv_tiers.disk",
    "servelab.plugins.kv_tiers.tiered",
    "servelab.plugins.routers.round_robin",
    "servelab.plugins.routers.least_load",
    "servelab.plugins.routers.power_of_two",
    "servelab.plugins.routers.prefix_affinity",
)

ENTRY_POINT_GROUP = "servelab"
DISABLE_ENV = "SERVELAB_DISABLE_PLUGINS"
BUILTIN = "built-in"
RUNTIME = "registered at runtime"  # origin of a plugin passed to `register` by code

EVENT_HOOKS: tuple[str, ...] = (
    "servelab_engine_ready",
    "servelab_step_end",
    "servelab_request_end",
    "servelab_run_end",
)


@dataclass(frozen=True)
class LoadError:
    """A plugin (or one of its registration hooks) skipped because it raised."""

    plugin: str
    origin: str
    error: BaseException

    def __str__(self) -> str:
        return f"{self.plugin} ({self.origin}): {type(self.error).__name__}: {self.error}"


@dataclass
class HookFailure:
    """An event-hook implementation that raised: its first error and how often it failed."""

    hook: str
    plugin: str
    first_error: BaseException
    count: int = 1


class ServelabPluginManager(pluggy.PluginManager):
    """A pluggy manager that also knows each plugin's origin and collects parts by kind."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self.origins: dict[str, str] = {}  # plugin name -> origin
        self.load_errors: list[LoadError] = []
        self.hook_failures: dict[tuple[str, str], HookFailure] = {}  # (hook, plugin) -> failure
        self._parts: dict[str, dict[str, PartInfo]] = {}  # kind -> parts; cleared on (un)register
        self._reported: set[tuple[str, str]] = set()  # (plugin, hook) registration failures

    # -- registering plugins

    def register(self, plugin: Any, name: str | None = None, origin: str = RUNTIME) -> str | None:
        """pluggy's `register`, recording where the plugin came from."""
        self._parts.clear()
        try:
            registered = super().register(plugin, name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name or plugin!r} ({origin}): {exc}") from exc
        if registered is not None:
            self.origins[registered] = origin
        return registered

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        self._parts.clear()
        key = name if name is not None else self.get_name(plugin)
        if key is not None:
            self.origins.pop(key, None)
        return super().unregister(plugin, name)

    def load_builtins(self, modules: Iterable[str], disabled: frozenset[str]) -> None:
        """Imports and registers each built-in module, under its module name."""
        for module_name in modules:
            if module_name in disabled:
                continue
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:
                self._report_load_error(module_name, BUILTIN, exc)
                continue
            self.register(module, name=module_name, origin=BUILTIN)

    def load_entry_points(self, disabled: frozenset[str]) -> None:
        """Loads and registers every entry point of group `servelab`, under its entry-point name."""
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry_point.name in disabled or entry_point.module in disabled:
                continue
            origin = _distribution_label(entry_point)
            if self.get_plugin(entry_point.name) is not None:
                other = f"{entry_point.name} ({self.origins.get(entry_point.name)})"
                self._report_load_error(entry_point.name, origin, PluginError(
                    f"two plugins are named {entry_point.name!r}: {other} and this one; "
                    f"uninstall one or disable it with {DISABLE_ENV}"
                ))  # fmt: skip
                continue
            try:
                plugin = entry_point.load()
            except Exception as exc:
                self._report_load_error(entry_point.name, origin, exc)
                continue
            if self.is_registered(plugin):
                continue  # an entry point naming a plugin already loaded (e.g. a built-in)
            self.register(plugin, name=entry_point.name, origin=origin)

    def check_pending(self) -> None:
        """pluggy's `check_pending`; a plugin with a hook that matches no
        specification (a misspelled hook) is unregistered, with a warning that
        names it and the known hooks."""
        while True:
            try:
                return super().check_pending()
            except pluggy.PluginValidationError as exc:
                name = self.get_name(exc.plugin) or repr(exc.plugin)
                origin = self.origins.get(name, RUNTIME)
                known = ", ".join(n for n in vars(hookspecs) if n.startswith("servelab_"))
                self.unregister(exc.plugin)
                self._report_load_error(name, origin, PluginError(f"{exc}; known hooks: {known}"))

    # -- parts

    def registered(self, kind: str) -> dict[str, PartInfo]:
        """Every part of `kind` registered by any plugin, in registration order."""
        get_kind(kind)
        if kind not in self._parts:
            self._parts[kind] = self._collect_parts(kind)
        return dict(self._parts[kind])

    def lookup(self, kind: str, name: str) -> type:
        """The class registered as `name`; `ConfigError` listing the registered names otherwise."""
        parts = self.registered(kind)
        if name in parts:
            return parts[name].cls
        message = f"unknown {kind} {name!r}; registered: {', '.join(sorted(parts)) or '(none)'}"
        if self.load_errors:
            message += "; plugins that failed to load: " + "; ".join(map(str, self.load_errors))
        raise ConfigError(message)

    def _collect_parts(self, kind: str) -> dict[str, PartInfo]:
        hook_name = KINDS[kind].hook
        parts: dict[str, PartInfo] = {}
        impls = getattr(self.hook, hook_name).get_hookimpls()  # in registration order
        # built-ins first, whatever tryfirst/trylast say: a built-in's name is never shadowed
        for impl in sorted(impls, key=lambda i: self.origins.get(i.plugin_name) != BUILTIN):
            plugin, origin = impl.plugin_name, self.origins.get(impl.plugin_name, RUNTIME)
            try:
                provided = impl.function() or {}
            except Exception as exc:
                self._report_once(plugin, origin, exc, hook_name)
                continue
            if not isinstance(provided, dict):
                error = PluginError(
                    f"must return a dict {{name: class}}, got {type(provided).__name__}"
                )
                self._report_once(plugin, origin, error, hook_name)
                continue
            for name, cls in provided.items():
                try:
                    info = part_info(kind, name, cls, plugin, origin)
                    if name in parts:
                        raise PluginError(
                            f"{kind} {name!r} is registered twice: by {parts[name].owner} "
                            f"and by {info.owner}; the first keeps the name"
                        )
                except PluginError as error:
                    self._report_once(plugin, origin, error, hook_name)
                    continue
                parts[name] = info
        return parts

    def _report_once(self, plugin: str, origin: str, error: Exception, hook: str) -> None:
        """A registration problem, logged the first time only (parts are collected again
        whenever a plugin is registered)."""
        if (plugin, str(error)) not in self._reported:
            self._reported.add((plugin, str(error)))
            self._report_load_error(plugin, origin, error, hook=hook)

    # -- events

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Calls every implementation of the event hook `hook_name`, each in isolation.

        One that raises is logged (with its traceback, the first time only: a
        per-step observer would flood the log), counted in `hook_failures`, and
        the others are still called. Wrapper implementations are not called.
        """
        if hook_name not in EVENT_HOOKS:
            raise ValueError(f"{hook_name!r} is not an event hook; event hooks: {EVENT_HOOKS}")
        caller = getattr(self.hook, hook_name)
        expected = set(caller.spec.argnames)
        if set(kwargs) != expected:
            raise TypeError(f"{hook_name} takes {sorted(expected)}, got {sorted(kwargs)}")
        # pluggy's own loop stops at the first exception; this one does not.
        for impl in reversed(caller.get_hookimpls()):  # pluggy's call order
            if impl.hookwrapper or impl.wrapper:
                continue
            try:
                impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception as exc:
                self._report_hook_failure(hook_name, impl.plugin_name, exc)

    def register_configs(self, store: Any) -> None:
        """Lets every plugin add Hydra config-group options to `store` (a ConfigStore);
        a plugin whose hook raises is disabled, with a warning."""
        for impl in reversed(self.hook.servelab_register_configs.get_hookimpls()):
            try:
                impl.function(*[{"store": store}[arg] for arg in impl.argnames])
            except Exception as exc:
                origin = self.origins.get(impl.plugin_name, RUNTIME)
                self.unregister(name=impl.plugin_name)
                self._report_load_error(
                    impl.plugin_name, origin, exc, hook="servelab_register_configs"
                )

    # -- reporting

    def _report_load_error(
        self, plugin: str, origin: str, exc: Exception, hook: str | None = None
    ) -> None:
        error = LoadError(plugin, origin, exc)
        self.load_errors.append(error)
        where = f" in {hook}" if hook else ""
        if origin == BUILTIN:
            logger.error(
                f"built-in plugin failed{where}, skipped (a servelab bug): {error}", exc_info=exc
            )
        else:
            # one line for a user; the traceback is for whoever debugs the plugin
            logger.warning(f"servelab plugin failed{where}, skipped: {error}")
            logger.debug("the plugin's error", exc_info=exc)

    def _report_hook_failure(self, hook: str, plugin: str, exc: Exception) -> None:
        failure = self.hook_failures.get((hook, plugin))
        if failure is not None:
            failure.count += 1
            return
        self.hook_failures[(hook, plugin)] = HookFailure(hook, plugin, exc)
        origin = self.origins.get(plugin, RUNTIME)
        logger.error(
            f"servelab plugin {plugin} ({origin}) raised in {hook}; the engine goes on "
            "and later failures of it are only counted",
            exc_info=exc,
        )


# -- the process-wide manager

_manager: ServelabPluginManager | None = None


def disabled_plugins() -> frozenset[str]:
    """Names listed in `SERVELAB_DISABLE_PLUGINS` (comma-separated)."""
    return frozenset(n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip())


def build_plugin_manager(builtins: Iterable[str] | None = None) -> ServelabPluginManager:
    """A fresh manager: built-ins (default `DEFAULT_PLUGINS`), entry points, disabled ones blocked."""
    pm = ServelabPluginManager()
    disabled = disabled_plugins()
    for name in disabled:
        pm.set_blocked(name)  # also refuses a later `register` under that name
    pm.load_builtins(DEFAULT_PLUGINS if builtins is None else builtins, disabled)
    pm.load_entry_points(disabled)
    pm.check_pending()
    return pm


def get_plugin_manager() -> ServelabPluginManager:
    """The process-wide manager, built on first use."""
    global _manager
    if _manager is None:
        _manager = build_plugin_manager()
    return _manager


def reset_plugin_manager() -> None:
    """Forgets the process-wide manager; the next `get_plugin_manager` rebuilds it (tests)."""
    global _manager
    _manager = None


def registered(kind: str) -> dict[str, PartInfo]:
    """Every part of `kind` ("scheduler", "allocator", "preemption", "attention")."""
    return get_plugin_manager().registered(kind)


def lookup(kind: str, name: str) -> type:
    """The class registered as `name` for `kind`; `ConfigError` listing the registered names otherwise."""
    return get_plugin_manager().lookup(kind, name)


def notify(hook_name: str, **kwargs: Any) -> None:
    """Calls the event hook `hook_name` on every plugin, each implementation isolated."""
    get_plugin_manager().notify(hook_name, **kwargs)


def _distribution_label(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = entry_point.dist
    if dist is None:
        return f"entry point {entry_point.value}"
    return f"{dist.name} {dist.version}"
