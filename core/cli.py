"""Console scripts: `servelab` (the Hydra app), `servelab-plugins`."""

from __future__ import annotations

import sys

from servelab.errors import ServelabError


def _hydra_app(cfg) -> None:
    from omegaconf import OmegaConf

    from servelab.runner import print_summary, run_config

    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("hydra", None)
    try:
        summary = run_config(config)
    except ServelabError as err:
        print(f"servelab: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    parts = ", ".join(
        f"{k}={config[k]['name']}" for k in ("scheduler", "allocator", "preemption", "attention")
    )
    print_summary(summary, title=parts)


def main() -> None:
    import hydra

    from servelab.plugin_manager import get_plugin_manager

    get_plugin_manager()  # plugins may add config-group options before Hydra composes
    app = hydra.main(version_base="1.3", config_path="pkg://servelab.conf", config_name="config")(
        _hydra_app
    )
    app()


def plugins_main() -> None:
    from servelab.plugin_manager import get_plugin_manager, registered

    get_plugin_manager()
    for kind in ("scheduler", "allocator", "preemption", "attention"):
        print(f"{kind}:")
        for name, info in sorted(registered(kind).items()):
            print(f"  {name:<14} {info.origin:<24} {info.description}")


def report_main() -> None:
    print("servelab-report: not implemented yet", file=sys.stderr)
    raise SystemExit(2)
