"""The `burstgpt` workload: replays a BurstGPT trace (HPMLL/BurstGPT, CSV with
the columns `Timestamp`, `Model`, `Request tokens`, `Response tokens`,
`Total tokens`, `Log Type`; later releases add `Session ID` and `Elapsed time`,
which are ignored). `Timestamp` is seconds since the trace began: arrivals are
its offsets. Lengths are `Request tokens` and `Response tokens` (`Total tokens`
is their sum and is not read); a row with 0 of either (a failed request in the
files with failures) is skipped and counted. `model` (`ChatGPT` | `GPT-4`) and
`log_type` (`Conversation log` | `API log`) keep only the rows with that value.
Prompts are seeded random tokens of the recorded length: the trace has no text.
Selection, time scale, rate rescale and caps: public_traces/common.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from servelab.lab.public_traces.common import (
    Row,
    TraceRequests,
    count,
    csv_rows,
    open_trace,
    seconds,
    timed_requests,
)

COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Log Type")


def burstgpt_workload(
    vocab_size: int,
    max_model_len: int | None = None,
    path: str | None = None,
    model: str | None = None,
    log_type: str | None = None,
    start_time: float | None = None,
    end_time: float | None = None,
    first_row: int = 0,
    num_requests: int | None = None,
    time_scale: float = 1.0,
    rate: float | None = None,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
) -> TraceRequests:
    """A BurstGPT CSV -> requests (module docstring)."""
    file, selection, build = open_trace("burstgpt", locals(), "BurstGPT_without_fails_2.csv")
    rows = selection.select(burstgpt_rows(file, model, log_type))
    return timed_requests("burstgpt", file, rows, selection, build, model=model, log_type=log_type)


def burstgpt_rows(file: Path, model: str | None, log_type: str | None) -> Iterator[Row]:
    for line, row in csv_rows(file, COLUMNS):
        if model is not None and row["Model"].strip() != model:
            continue
        if log_type is not None and row["Log Type"].strip() != log_type:
            continue
        yield Row(
            line,
            seconds(file, line, "Timestamp", row["Timestamp"]),
            count(file, line, "Request tokens", row["Request tokens"]),
            count(file, line, "Response tokens", row["Response tokens"]),
        )
