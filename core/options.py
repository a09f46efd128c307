"""From a config node to a part: `{"name": "paged", "block_size": 16}` -> `PagedAllocator(...)`.

Rules:
- a node is a bare name (`"paged"`) or a mapping with `name` plus that part's
  options;
- a part's options are the keyword parameters of its constructor, minus the
  engine-supplied context parameters of its kind (`CONTEXT_PARAMS`);
- an unknown option is a `ConfigError` listing the accepted ones; a user
  never sets a context parameter, the engine always does;
- `construct` is the one place a node becomes an object:
  `cls(**options, **context)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from servelab.errors import ConfigError

# What the engine passes to every part of a kind. Kept here, once, so option
# validation and the engine cannot disagree. Allocators get capacities in
# tokens, not blocks: the engine sizes every allocator from one memory budget
# before knowing its block size.
CONTEXT_PARAMS: dict[str, frozenset[str]] = {
    "scheduler": frozenset(
        {"allocator", "preemption", "max_num_seqs", "max_num_batched_tokens", "max_model_len"}
    ),
    "allocator": frozenset({"token_capacity", "host_token_capacity", "max_model_len"}),
    "preemption": frozenset(),
    "attention": frozenset({"num_heads", "num_kv_heads", "head_dim", "scale"}),
}


def check_kind(kind: str) -> None:
    """Raises `ConfigError` unless `kind` is one of the four contracts."""
    if kind not in CONTEXT_PARAMS:
        raise ConfigError(f"unknown kind {kind!r}; kinds: {', '.join(CONTEXT_PARAMS)}")


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
    check_kind(kind)
    context = CONTEXT_PARAMS[kind]
    options: dict[str, Any] = {}
    for params in _constructor_chain(cls):
        for param in params:
            if param.name not in context and param.name not in options:
                options[param.name] = (
                    REQUIRED if param.default is inspect.Parameter.empty else param.default
                )
    return options


def construct(kind: str, spec: Any, **context: Any) -> Any:
    """Looks up the part named by `spec`, validates its options, returns
    `cls(**options, **context)` with `.name` set to the registered name."""
    # Imported here: plugin_manager imports this module for `describe_options`.
    from servelab.plugin_manager import lookup

    check_kind(kind)
    unexpected = set(context) - CONTEXT_PARAMS[kind]
    if unexpected:
        # An engine bug, not a user error: CONTEXT_PARAMS is the contract.
        raise TypeError(f"context {sorted(unexpected)} is not in CONTEXT_PARAMS[{kind!r}]")
    name, options = split_component(spec, kind)
    cls = lookup(kind, name)
    accepted = describe_options(cls, kind)
    check_options(kind, name, options, accepted)
    part = cls(**options, **context)
    part.name = name  # the registered name, for error messages and reports
    return part


def check_options(
    kind: str, name: str, options: Mapping[str, Any], accepted: dict[str, Any]
) -> None:
    """Raises `ConfigError` for an unknown option or a missing required one."""
    unknown = [key for key in options if key not in accepted]
    if unknown:
        listed = ", ".join(accepted) or "(none)"
        noun = "option" if len(unknown) == 1 else "options"
        message = f"unknown {noun} {', '.join(map(repr, unknown))} for {kind} {name!r}; accepted: {listed}"
        from_engine = [key for key in unknown if key in CONTEXT_PARAMS[kind]]
        if from_engine:
            message += f" ({', '.join(from_engine)} is supplied by the engine)"
        raise ConfigError(message)
    missing = [
        key for key, default in accepted.items() if default is REQUIRED and key not in options
    ]
    if missing:
        raise ConfigError(f"{kind} {name!r} needs option {', '.join(map(repr, missing))}")


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
