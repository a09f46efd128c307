"""The `azure_llm` workload: replays an Azure LLM inference trace
(Azure/AzurePublicDataset: AzureLLMInferenceTrace_{code,conv}.csv of 2023 and
the week-long {code,conv} files of 2024), CSV with the columns `TIMESTAMP`,
`ContextTokens`, `GeneratedTokens`. `TIMESTAMP` is a wall-clock date-time,
`2023-11-16 18:15:46.6805900` (up to 7 fractional digits, 100 ns ticks; a `T`
separator and a `+00:00` or `Z` zone are accepted): arrivals are offsets from
the first kept row, computed from whole seconds and fractions apart so no
precision is lost to the epoch. The code and conversation variants are the same
format; which one is replayed is the file (its name and hash go into the run's
provenance). Prompts are seeded random tokens of `ContextTokens`; outputs are
`GeneratedTokens`. Selection, time scale, rate rescale and caps: common.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

from servelab.lab.public_traces.common import (
    Row,
    TraceRequests,
    bad_row,
    count,
    csv_rows,
    open_trace,
    timed_requests,
)

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
DATE_TIME = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?\s*(Z|[+-]\d\d:?\d\d)?"
)
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def azure_llm_workload(
    vocab_size: int,
    max_model_len: int | None = None,
    path: str | None = None,
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
    """An Azure LLM inference trace CSV -> requests (module docstring)."""
    file, selection, build = open_trace("azure_llm", locals(), "AzureLLMInferenceTrace_conv.csv")
    rows = selection.select(azure_rows(file))
    return timed_requests("azure_llm", file, rows, selection, build)


def azure_rows(file: Path) -> Iterator[Row]:
    origin = None  # the first row's whole epoch second: times are offsets from it
    for line, row in csv_rows(file, COLUMNS):
        whole, fraction = date_time(file, line, row["TIMESTAMP"])
        origin = whole if origin is None else origin
        yield Row(
            line,
            (whole - origin) + fraction,
            count(file, line, "ContextTokens", row["ContextTokens"]),
            count(file, line, "GeneratedTokens", row["GeneratedTokens"]),
        )


def date_time(file: Path, line: int, text: str) -> tuple[int, float]:
    """`2023-11-16 18:15:46.6805900` -> (whole seconds since the epoch, fraction)."""
    match = DATE_TIME.fullmatch(text.strip())
    try:
        if match is None:
            raise ValueError
        year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
        moment = datetime(year, month, day, hour, minute, second, tzinfo=timezone.utc)
    except ValueError:
        raise bad_row(
            file, line, f"TIMESTAMP is not a date-time like 2023-11-16 18:15:46.6805900: {text!r}"
        ) from None
    zone = match.group(8)
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        digits = zone[1:].replace(":", "")
        moment -= sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
    digits = match.group(7) or "0"
    return int((moment - EPOCH).total_seconds()), int(digits) / 10 ** len(digits)
