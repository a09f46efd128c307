"""One benchmark run inside a device-check phase: its deadline, its live row, and
the step shapes its roofline needs.

A phase of `gpu_check.sh` is one process under `timeout`; its limit covers
everything the process does: importing torch, initialising the CUDA context,
building the engine (weights on the device, KV cache, graph capture), the first
Triton compiles, the warm-up and the timed run. So the run's row is written the
moment the run starts and rewritten at every stage: a process killed at its
limit still leaves a row naming the stage it stopped in. The timed loop stops
at the deadline on its own (leaving `MARGIN_S` to write the row); SIGTERM from
`timeout` raises `PhaseTimeout` wherever Python code runs next.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict, dataclass

MARGIN_S = 5.0  # kept back from the deadline: free the engine, write the row, exit


class PhaseTimeout(BaseException):
    """The phase's deadline passed (or `timeout` sent SIGTERM) in `stage`. A
    BaseException, like KeyboardInterrupt: the engine's step catches Exception (a
    failed step fails its requests and goes on), and a timeout must end the run."""


class StepFailed(Exception):
    """A step raised or a request ended in an error: the run gives no figure."""


class Phase:
    """The deadline of one process's runs and the file their rows go to.

    `started` is when the process started (before torch was imported);
    `limit_s` None means no deadline (a run by hand)."""

    def __init__(self, started: float, limit_s: float | None, records: str | None) -> None:
        self.started, self.limit_s, self.records = started, limit_s, records
        self.stage = "starting"

    @property
    def deadline(self) -> float:
        return float("inf") if self.limit_s is None else self.started + self.limit_s - MARGIN_S

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def enter(self, stage: str, row=None) -> None:
        """Starts `stage`: the row (a RunResult) says so on disk, then the deadline
        is checked (a stage must not start once it has passed)."""
        self.stage = stage
        if row is not None:
            row.status = f"running: {stage}"
            self.write(row)
        if time.monotonic() > self.deadline:
            raise PhaseTimeout(self.timeout_message())

    def timeout_message(self) -> str:
        return f"timed out while {self.stage} ({self.elapsed():.0f} s of the {self.limit_s:.0f} s limit)"

    def write(self, row) -> None:
        """Appends the row's current state (one JSON line; the last one of a
        (backend, graphs) pair is its state)."""
        if self.records:
            with open(self.records, "a") as f:
                f.write(json.dumps({"kind": "run", **asdict(row)}) + "\n")

    def write_header(self, text: str) -> None:
        """The workload and device line the merged report puts above the table."""
        if self.records:
            with open(self.records, "a") as f:
                f.write(json.dumps({"kind": "header", "text": text}) + "\n")

    def raise_on_sigterm(self) -> None:
        """`timeout` sends SIGTERM at the limit: raise where Python runs next, so
        the run's row says where it stopped (SIGKILL follows if it does not return)."""

        def stop(signum, frame):
            raise PhaseTimeout(self.timeout_message())

        signal.signal(signal.SIGTERM, stop)


@dataclass
class StepShape:
    context_tokens: int  # sum of the scheduled sequences' context after the step
    decode_only: bool


class StepShapes:
    """Records each step's scheduled context by wrapping the scheduler's
    `schedule()`, keyed by the index the engine gives that step's record. A step
    that fails gets no record and does not advance the index: the next step's
    shape replaces its shape, so records and shapes never drift apart."""

    def __init__(self, engine) -> None:
        self.shapes: dict[int, StepShape] = {}
        schedule = engine.scheduler.schedule

        def recording_schedule():
            plan = schedule()
            if not (plan.is_empty and not plan.preempted):
                # the plan's rows as arrays: no host work per row
                self.shapes[engine.step_index] = StepShape(
                    context_tokens=int((plan.starts + plan.counts).sum()),
                    decode_only=plan.num_tokens == len(plan.seqs),
                )
            return plan

        engine.scheduler.schedule = recording_schedule

    def pair(self, records) -> list[tuple]:
        """(StepRecord, StepShape) for each record, matched by step index."""
        missing = [r.step for r in records if r.step not in self.shapes]
        if missing:
            raise StepFailed(f"step records {missing[:5]} have no scheduled shape")
        return [(r, self.shapes[r.step]) for r in records]
