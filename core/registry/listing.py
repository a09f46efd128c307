"""`servelab-plugins`: what the plugin manager found.

Lists every registered part by kind — name, origin (`built-in`, or the
distribution's name and version), options with their defaults, one line of
description — then the plugins that observe events or add config options, and
the plugins that failed to load with their errors.

    servelab-plugins                # everything
    servelab-plugins scheduler      # one kind
    servelab-plugins --json         # the same, machine-readable
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from servelab.contracts.kinds import KINDS
from servelab.errors import PluginError
from servelab.registry.options import REQUIRED
from servelab.registry.parts import PartInfo
from servelab.registry.plugin_manager import (
    EVENT_HOOKS,
    RUNTIME,
    ServelabPluginManager,
    get_plugin_manager,
)

OTHER_HOOKS = (*EVENT_HOOKS, "servelab_register_configs")
INDENT = "  "


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    kinds = [args.kind] if args.kind else list(KINDS)
    try:
        pm = get_plugin_manager()
        parts = {kind: pm.registered(kind) for kind in kinds}
    except PluginError as err:  # e.g. two plugins registering one name
        print(f"servelab-plugins: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    listing = {
        "parts": {
            kind: [_part_dict(info) for info in _sorted(found)] for kind, found in parts.items()
        },
        "hooks": _other_hooks(pm),
        "failed": [
            {
                "plugin": e.plugin,
                "origin": e.origin,
                "error": f"{type(e.error).__name__}: {e.error}",
            }
            for e in pm.load_errors
        ],
    }
    print(json.dumps(listing, indent=2, default=repr) if args.json else render(listing))


def render(listing: dict[str, Any]) -> str:
    """The listing as aligned text, one section per kind."""
    lines: list[str] = []
    for kind, infos in listing["parts"].items():
        lines.append(f"{kind}:")
        if not infos:
            lines.append(f"{INDENT}(none)")
        name_width = max((len(i["name"]) for i in infos), default=0) + 2
        origin_width = max((len(i["origin"]) for i in infos), default=0) + 2
        for info in infos:
            lines.append(
                f"{INDENT}{info['name']:<{name_width}}{info['origin']:<{origin_width}}"
                f"{info['description']}".rstrip()
            )
            options = ", ".join(f"{k}={_show(v)}" for k, v in info["options"].items()) or "(none)"
            lines.append(f"{INDENT}{'':<{name_width}}options: {options}")
        lines.append("")
    if listing["hooks"]:
        lines.append("observers and config hooks:")
        width = max(len(h["plugin"]) for h in listing["hooks"]) + 2
        for hook in listing["hooks"]:
            lines.append(
                f"{INDENT}{hook['plugin']:<{width}}{hook['origin']}: {', '.join(hook['hooks'])}"
            )
        lines.append("")
    if listing["failed"]:
        lines.append("plugins that failed to load:")
        for failed in listing["failed"]:
            lines.append(f"{INDENT}{failed['plugin']} ({failed['origin']}): {failed['error']}")
        lines.append("")
    return "\n".join(lines).rstrip()


# -- helpers


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="servelab-plugins",
        description="List servelab's registered parts, their origins and options, "
        "and the plugins that failed to load.",
    )
    parser.add_argument("kind", nargs="?", choices=list(KINDS), help="one kind only")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def _sorted(parts: dict[str, PartInfo]) -> list[PartInfo]:
    return [parts[name] for name in sorted(parts)]


def _part_dict(info: PartInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "origin": info.origin,
        "plugin": info.plugin,
        "class": f"{info.cls.__module__}.{info.cls.__qualname__}",
        "description": info.description,
        "options": dict(info.options),  # raw defaults; REQUIRED prints as <required>
    }


def _show(default: Any) -> str:
    """A default as the user would type it on the command line (`<required>` where none)."""
    if default is REQUIRED:
        return repr(REQUIRED)
    if default is None:
        return "null"
    if isinstance(default, bool):
        return str(default).lower()
    return str(default)


def _other_hooks(pm: ServelabPluginManager) -> list[dict[str, Any]]:
    """Plugins implementing event hooks or `servelab_register_configs`, with those hooks."""
    found: dict[str, list[str]] = {}
    for hook_name in OTHER_HOOKS:
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            found.setdefault(impl.plugin_name, []).append(hook_name)
    return [
        {"plugin": plugin, "origin": pm.origins.get(plugin, RUNTIME), "hooks": hooks}
        for plugin, hooks in sorted(found.items())
    ]


if __name__ == "__main__":
    main()
