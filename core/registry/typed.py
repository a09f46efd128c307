"""Option values checked against their declared types: the annotations of a
part's constructor, or the engine's table of option types.

A config value must be what the annotation says, as YAML and Hydra spell it:
`bool` takes only true/false (never the strings "no" or "false", never 0/1),
`int` takes integers but not bools or 2.5, `float` takes finite numbers, `str`
takes strings, `X | None` also takes null. Annotations this checker does not
understand (a class, a mapping of options) are left to the part's own checks.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from servelab.errors import ConfigError
from servelab.step.sequence import finite_number, is_integer

_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


def type_problem(value: Any, annotation: Any) -> str | None:
    """What `value` is not, for `annotation` (None: it fits, or the annotation is
    not one this module checks)."""
    choices = _choices(annotation)
    if choices is None:
        return None
    if any(_fits(value, choice) for choice in choices):
        return None
    return " or ".join("null" if c is type(None) else _NAMES[c] for c in choices)


def check_value(what: str, value: Any, annotation: Any) -> None:
    """Raises ConfigError naming `what`, the value and the type it must be."""
    expected = type_problem(value, annotation)
    if expected is not None:
        raise ConfigError(f"{what} must be {expected}, got {value!r}")


def annotations_of(function: Any) -> dict[str, Any]:
    """The resolved annotations of `function` ({} where they cannot be resolved)."""
    try:
        return typing.get_type_hints(function)
    except Exception:  # a forward reference to a name its module cannot see
        return {}


def _choices(annotation: Any) -> list[type] | None:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
    else:
        members = (annotation,)
    if all(m in _NAMES or m is type(None) for m in members):
        return list(members)
    return None


def _fits(value: Any, choice: type) -> bool:
    if choice is type(None):
        return value is None
    if choice is bool:
        return isinstance(value, bool)
    if choice is int:
        return is_integer(value)
    if choice is float:
        return finite_number(value) is not None
    return isinstance(value, choice)
