"""servelab-sjf: the plugin module servelab loads through the entry point
`sjf = servelab_sjf` (group `servelab`).

Its hook implementations:
- `servelab_register_schedulers`: the `sjf` scheduler;
- `servelab_register_configs`: `scheduler=sjf` as a Hydra config-group option;
- `servelab_engine_ready` / `servelab_step_end`: the JSONL step trace, on when
  `SERVELAB_SJF_TRACE` names a file.
"""

from __future__ import annotations

from typing import Any

from servelab import hookimpl
from servelab.registry.options import describe_options

from servelab_sjf.scheduler import ShortestJobFirst
from servelab_sjf.trace import TRACE_ENV, servelab_engine_ready, servelab_step_end

__all__ = [
    "TRACE_ENV",
    "ShortestJobFirst",
    "servelab_engine_ready",
    "servelab_register_configs",
    "servelab_register_schedulers",
    "servelab_step_end",
]
__version__ = "0.1.0"

SCHEDULER_NAME = "sjf"


@hookimpl
def servelab_register_schedulers() -> dict[str, type]:
    return {SCHEDULER_NAME: ShortestJobFirst}


@hookimpl
def servelab_register_configs(store: Any) -> None:
    # The node lists every option with its default, read from the constructor,
    # so `scheduler=sjf scheduler.ageing=0.2` works and the defaults cannot drift.
    node = {"name": SCHEDULER_NAME, **describe_options(ShortestJobFirst, "scheduler")}
    store.store(group="scheduler", name=SCHEDULER_NAME, node=node)
