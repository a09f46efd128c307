"""Progress of a long job, shown the way its output is read: a live bar on a
terminal (rich), plain lines otherwise (a log file, nohup, CI), where a bar
would print nothing until the end or fill the log with control codes.

`Progress(label, total)` counts steps of a job; `advance(what)` moves one on.
Plain lines go out at most every `every` seconds or each `share` of the job,
and always at the end, so a log shows the job is alive without one line per
step. Output goes to stderr, so a command's stdout stays its result.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    def __init__(self, label: str, total: int, enabled: bool = True, stream: TextIO | None = None,
                 every: float = 10.0, share: float = 0.1) -> None:  # fmt: skip
        self.label, self.total, self.done = label, max(int(total), 0), 0
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.total > 0
        self.every, self.share = every, share
        self.started = self.last_time = time.monotonic()
        self.last_done = 0
        self.bar = None
        if self.enabled and is_terminal(self.stream):
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.description}"), TimeElapsedColumn(),
                           console=Console(file=self.stream), transient=True)  # fmt: skip
            self.task = self.bar.add_task("", total=self.total)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def advance(self, what: str = "", steps: int = 1, detail: str = "") -> None:
        self.done = min(self.total, self.done + steps)
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, description=what)
            return
        now = time.monotonic()
        due = (now - self.last_time >= self.every
               or self.done - self.last_done >= self.share * self.total or self.done == self.total)  # fmt: skip
        if due:
            self.last_time, self.last_done = now, self.done
            tail = f" ({detail})" if detail else ""
            print(f"{self.label}: {self.done}/{self.total} {what}{tail}, "
                  f"{now - self.started:.1f} s", file=self.stream, flush=True)  # fmt: skip
