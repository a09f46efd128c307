"""A per-step JSONL trace, written through servelab's event hooks.

Set `SERVELAB_SJF_TRACE=/path/trace.jsonl` and every engine step appends one
JSON object: the step's metrics record (`servelab_step_end`'s `step`), the
scheduler's queue figures, and `run`, which tells engines apart (one process
may build several, e.g. a Hydra sweep). The file is appended to, never
truncated, and is opened per line, so several engines can share it.
"""

from __future__ import annotations

import itertools
import json
import os
import weakref
from typing import Any

from servelab import hookimpl

TRACE_ENV = "SERVELAB_SJF_TRACE"

_run_ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_counter = itertools.count()


def trace_path() -> str | None:
    return os.environ.get(TRACE_ENV) or None


def run_id(engine: Any) -> str:
    """`<pid>-<n>`: the n-th engine this process traced."""
    if engine not in _run_ids:
        _run_ids[engine] = f"{os.getpid()}-{next(_counter)}"
    return _run_ids[engine]


@hookimpl
def servelab_engine_ready(engine: Any) -> None:
    if trace_path():
        run_id(engine)  # number engines in the order they were built


@hookimpl
def servelab_step_end(engine: Any, step: dict[str, Any]) -> None:
    path = trace_path()
    if not path:
        return
    stats = engine.scheduler.stats() if hasattr(engine.scheduler, "stats") else {}
    record = {"run": run_id(engine), **step, "scheduler": {k: stats[k] for k in sorted(stats)}}
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record, default=str) + "\n")
