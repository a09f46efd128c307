"""A part's options: the keyword parameters of its constructor, minus the
context its kind gets from the engine (`servelab.contracts.kinds`).

Rules: a config node is a bare name (`"paged"`) or a mapping with `name` plus
that part's options; an unknown option is a `ConfigError` listing the accepted
ones; a user never sets a context parameter, the engine always does.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from servelab.contracts.kinds import kind as get_kind
from servelab.errors import ConfigError
from servelab.registry.typed import annotations_of, check_value


class _Required:
    """Default of an option the user must set (its parameter has no default)."""

    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = _Required()


def split_component(spec: Any, kind: str = "component") -> tuple[str, dict[str, Any]]:
    """`"paged"` -> `("paged", {})`; `{"name": "paged", "block_size": 8}` -> `("paged", {"block_size": 8})`.

    Accepts an OmegaConf `DictConfig` (resolved to plain containers first).
    """
    if isinstance(spec, str):
        return spec, {}
    spec = _to_plain(spec)
    if not isinstance(spec, Mapping):
        raise ConfigError(f"a {kind} is a name or a mapping with 'name'; got {spec!r}")
    options = dict(spec)
    name = options.pop("name", None)
    if not isinstance(name, str) or not name:
        keys = ", ".join(map(str, spec)) or "(none)"
        raise ConfigError(f"a {kind} config node needs a 'name'; got keys: {keys}")
    return name, options


def describe_options(cls: type, kind: str) -> dict[str, Any]:
    """The user options of `cls`: `{parameter: default}`, `REQUIRED` where there is none.

    Follows `**kwargs` up the MRO: a constructor that forwards `**kwargs` to
    its base also accepts the base constructor's keyword parameters.
    """
    context = get_kind(kind).context
    options: dict[str, Any] = {}
    for params in _constructor_chain(cls):
        for param in params:
            if param.name not in context and param.name not in options:
                options[param.name] = (
                    REQUIRED if param.default is inspect.Parameter.empty else param.default
                )
    return options


def declared_variants(cls: type) -> list[dict[str, Any]]:
    """The option sets a part declares for the oracle and the conformance kit to run it
    under: its class attribute `oracle_variants` (e.g. an allocator's
    `({"block_size": 4, "prefix_caching": True},)`, so its cache's code runs), else
    one set, its defaults. Refused (ConfigError) unless a non-empty sequence of
    mappings; each set's options are checked where it is used, as a config node's."""
    declared = getattr(cls, "oracle_variants", None)
    if declared is None:
        return [{}]
    if (
        isinstance(declared, (str, Mapping))
        or not isinstance(declared, (list, tuple))
        or not declared
        or not all(isinstance(options, Mapping) for options in declared)
    ):
        raise ConfigError(
            f"{cls.__qualname__}.oracle_variants must be a non-empty list or tuple of option "
            f"dicts, e.g. ({{'prefix_caching': True}},); got {declared!r}"
        )
    return [dict(options) for options in declared]


def check_options(
    kind: str, name: str, options: Mapping[str, Any], accepted: dict[str, Any]
) -> None:
    """Raises `ConfigError` for an unknown option or a missing required one."""
    unknown = [key for key in options if key not in accepted]
    if unknown:
        listed = ", ".join(accepted) or "(none)"
        noun = "option" if len(unknown) == 1 else "options"
        message = f"unknown {noun} {', '.join(map(repr, unknown))} for {kind} {name!r}; accepted: {listed}"
        from_engine = [key for key in unknown if key in get_kind(kind).context]
        if from_engine:
            message += f" ({', '.join(from_engine)} is supplied by the engine)"
        raise ConfigError(message)
    missing = [
        key for key, default in accepted.items() if default is REQUIRED and key not in options
    ]
    if missing:
        raise ConfigError(f"{kind} {name!r} needs option {', '.join(map(repr, missing))}")


def check_option_types(cls: type, kind: str, name: str, options: Mapping[str, Any]) -> None:
    """Raises ConfigError for an option whose value its constructor's annotation
    refuses (see `servelab.registry.typed`), naming the option and the type."""
    annotations: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is not None:
            annotations.update(annotations_of(init))
    for key, value in options.items():
        if key in annotations:
            check_value(f"{kind} {name!r} option {key}", value, annotations[key])


def _constructor_chain(cls: type) -> Iterator[list[inspect.Parameter]]:
    """Yields the keyword parameters of each `__init__` reached through `**kwargs`."""
    for klass in cls.__mro__:
        if klass is object:
            return
        init = klass.__dict__.get("__init__")
        if init is None:
            continue  # inherits its base's constructor: keep walking
        params = list(inspect.signature(init).parameters.values())[1:]  # drop self
        keywords = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        yield keywords
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return


def _to_plain(spec: Any) -> Any:
    if isinstance(spec, DictConfig):
        return OmegaConf.to_container(spec, resolve=True)
    return spec
