"""One registered part: checked against its kind's contract when a plugin
registers it, and described for `servelab-plugins` (its plugin, origin,
one-line description and options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servelab.contracts.kinds import KINDS
from servelab.errors import PluginError
from servelab.registry.options import describe_options


@dataclass(frozen=True)
class PartInfo:
    """One registered part: what `servelab-plugins` lists."""

    kind: str
    name: str
    cls: type
    plugin: str  # the plugin that registered it: module or entry-point name
    origin: str  # "built-in" or "<distribution> <version>"
    description: str
    options: dict[str, Any]  # user option -> default (`options.REQUIRED` where none)

    @property
    def owner(self) -> str:
        return f"{self.plugin} ({self.origin})"


def part_info(kind: str, name: Any, cls: Any, plugin: str, origin: str) -> PartInfo:
    """Checks one registered part against its contract; `PluginError` naming the owner otherwise."""
    owner = f"{plugin} ({origin})"
    contract = KINDS[kind].contract
    if not isinstance(name, str) or not name:
        raise PluginError(f"{owner} registered a {kind} under {name!r}; a name is a non-empty str")
    if not (isinstance(cls, type) and issubclass(cls, contract)):
        raise PluginError(
            f"{kind} {name!r} of {owner} is {cls!r}, which does not subclass "
            f"{contract.__module__}.{contract.__name__}"
        )
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise PluginError(
            f"{kind} {name!r} of {owner}: class {cls.__module__}.{cls.__qualname__} does not "
            f"implement {', '.join(missing)} of {contract.__name__}"
        )
    return PartInfo(
        kind=kind,
        name=name,
        cls=cls,
        plugin=plugin,
        origin=origin,
        description=_description(cls),
        options=describe_options(cls, kind),
    )


def _description(cls: type) -> str:
    description = getattr(cls, "description", "")
    if description:
        return str(description)
    doc = cls.__dict__.get("__doc__") or ""
    return doc.strip().split("\n", 1)[0]
