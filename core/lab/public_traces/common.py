"""What every public-trace reader shares: a row of a trace (its line, its
arrival time in seconds, its lengths), the one-line error a bad row raises, the
selection every reader applies in the same order, and the provenance of the
replay.

Selection, in this order: the reader's own filters (model, log type); the time
window `[start_time, end_time)` in seconds after the file's first row; the
first `first_row` remaining rows are skipped; then at most `num_requests` are
kept. Arrival offsets start at 0 at the first kept row and are multiplied by
`time_scale`, or, when `rate` is given, stretched so the kept rows arrive at
`rate` requests per second on average. Lengths are capped at `max_input_len`
and `max_output_len` and at what the engine serves (`max_model_len`); every
capped request is counted in the provenance, never silently dropped.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servelab.errors import ConfigError
from servelab.lab.request_builder import RequestBuilder, WorkloadRequest
from servelab.step.sequence import finite_number


class TraceRequests(list):
    """The requests of a replayed trace, with `source`: what was read and how
    much was capped (the runner writes it into the run's provenance)."""

    source: dict[str, Any]


@dataclass
class Row:
    """One request of a trace as read: its 1-based line in the file, its arrival
    in seconds (relative to any fixed origin), its lengths and, for a trace with
    block hashes, the hash ids."""

    line: int
    time: float
    input_len: int
    output_len: int
    extra: Any = None


SELECTION_OPTIONS = ("start_time", "end_time", "first_row", "num_requests", "time_scale", "rate",
                     "max_input_len", "max_output_len", "max_model_len")  # fmt: skip


def open_trace(reader: str, options: dict, example: str) -> tuple[Path, Selection, RequestBuilder]:
    """A reader's file, selection and request builder from its options (its `locals()`)."""
    file = trace_file(options["path"], reader, example)
    selection = Selection(**{k: options[k] for k in SELECTION_OPTIONS if k in options})
    build = RequestBuilder(options["vocab_size"], options["max_model_len"], options["seed"],
                           options["temperature"], options["ignore_eos"])  # fmt: skip
    return file, selection, build


def trace_file(path: str | None, reader: str, example: str) -> Path:
    """The file `workload.path` names; a missing option or file is a ConfigError."""
    if not path:
        raise ConfigError(
            f"workload {reader} needs `path`: a local file, e.g. workload.path={example}"
        )
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise ConfigError(f"workload {reader}: no such file {str(file)!r}")
    return file


def file_sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def bad_row(file: Path, line: int, problem: str) -> ConfigError:
    """The one-line error of a bad row: `FILE:LINE: PROBLEM`."""
    return ConfigError(f"{file}:{line}: {problem}")


def count(file: Path, line: int, column: str, text: Any) -> int:
    """A token count: a whole number >= 0 (`12`, or `12.0` as some CSV writers put it)."""
    value = text
    if isinstance(text, str):
        try:
            value = float(text.strip()) if text.strip() else None
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_row(file, line, f"{column} is not a whole number: {text!r}")
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise bad_row(file, line, f"{column} is not a whole number >= 0: {text!r}")
    return int(value)


def seconds(file: Path, line: int, column: str, text: Any, unit: float = 1.0) -> float:
    """A relative time in `unit` seconds (BurstGPT: seconds; Mooncake: milliseconds)."""
    value = text
    if isinstance(text, str):
        try:
            value = float(text.strip())
        except ValueError:
            value = None
    number = finite_number(value) if not isinstance(value, bool) else None
    if number is None or number < 0:
        raise bad_row(file, line, f"{column} is not a time >= 0: {text!r}")
    return number * unit


@dataclass
class Selection:
    """The common options of every reader (module docstring)."""

    start_time: float | None = None
    end_time: float | None = None
    first_row: int = 0
    num_requests: int | None = None
    time_scale: float = 1.0
    rate: float | None = None
    max_input_len: int | None = None
    max_output_len: int | None = None
    max_model_len: int | None = None
    stats: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("start_time", "end_time", "rate"):
            value = getattr(self, name)
            if value is not None and (finite_number(value) is None or value < 0):
                raise ConfigError(f"workload {name} must be a finite number >= 0, got {value!r}")
        if self.rate is not None and self.rate <= 0:
            raise ConfigError(f"workload rate must be > 0 requests per second, got {self.rate!r}")
        scale = finite_number(self.time_scale)
        if scale is None or scale < 0:
            raise ConfigError(
                f"workload time_scale must be a finite number >= 0, got {self.time_scale!r}"
            )
        if self.rate is not None and self.time_scale != 1.0:
            raise ConfigError("workload: give rate or time_scale, not both (rate sets the scale)")
        for name, low in (("first_row", 0), ("num_requests", 1), ("max_input_len", 1),
                          ("max_output_len", 1)):  # fmt: skip
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= low):
                raise ConfigError(
                    f"workload {name} must be an integer >= {low} or null, got {value!r}"
                )
        self.stats = {"rows_read": 0, "skipped_zero_length": 0, "capped_input": 0,
                      "capped_output": 0}  # fmt: skip

    def select(self, rows: Iterable[Row], timed: bool = True) -> list[Row]:
        """The rows kept, in file order. Stops reading once `num_requests` are kept
        (a trace is in time order), so a long file's head is read, not all of it."""
        kept: list[Row] = []
        origin = None
        skipped = 0
        for row in rows:
            self.stats["rows_read"] += 1
            origin = row.time if origin is None else origin
            if row.input_len == 0 or row.output_len == 0:  # nothing to serve (a failed request)
                self.stats["skipped_zero_length"] += 1
                continue
            offset = row.time - origin
            if timed and self.start_time is not None and offset < self.start_time:
                continue
            if timed and self.end_time is not None and offset >= self.end_time:
                break
            if skipped < self.first_row:
                skipped += 1
                continue
            kept.append(row)
            if self.num_requests is not None and len(kept) >= self.num_requests:
                break
        return kept

    def arrivals(self, rows: list[Row]) -> list[float]:
        """Arrival offsets in seconds of the kept rows: 0 at the first, scaled."""
        if not rows:
            return []
        first = min(r.time for r in rows)
        offsets = [r.time - first for r in rows]
        scale = self.time_scale
        span = max(offsets)
        if self.rate is not None:
            if len(rows) < 2 or span <= 0:
                raise ConfigError(
                    "workload rate: the selected rows all arrive at once, so there is no rate to "
                    "rescale (select more rows or drop rate)"
                )
            scale = (len(rows) - 1) / (self.rate * span)  # the last arrives at (n - 1) / rate
        self.stats["time_scale"] = scale
        return [t * scale for t in offsets]

    def input_cap(self) -> float:
        """The longest prompt served uncapped."""
        limit = self.max_model_len
        return min([math.inf, *_given(self.max_input_len, limit and limit - 1)])

    def lengths(self, input_len: int, output_len: int) -> tuple[int, int]:
        """Lengths capped at the options and at what the engine serves (the prompt
        first, the output in the room left); each capped request is counted."""
        limit = self.max_model_len
        new_in = min([input_len, *_given(self.max_input_len, limit and limit - 1)])
        new_out = min([output_len, *_given(self.max_output_len, limit and limit - new_in)])
        self.stats["capped_input"] += new_in < input_len
        self.stats["capped_output"] += new_out < output_len
        return new_in, new_out


def _given(*caps: int | None) -> list[int]:
    return [c for c in caps if c is not None]


def replayed(
    requests: list[WorkloadRequest], file: Path, reader: str, selection: Selection, **extra: Any
) -> TraceRequests:
    """`requests` sorted by arrival (stable), carrying the provenance of the replay."""
    if not requests:
        raise ConfigError(f"workload {reader}: {file} holds no request the selection keeps")
    out = TraceRequests(sorted(requests, key=lambda r: r.arrival_time))
    out.source = {
        "trace": reader,
        "file": file.name,
        "path": str(file),
        "sha256": file_sha256(file),
        "requests": len(out),
        **selection.stats,
        **extra,
    }
    return out


def numbered_lines(file: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 text file, read lazily; bad bytes name their line."""
    with file.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise bad_row(
                    file, lineno, f"not UTF-8 text (byte {raw[err.start]:#04x})"
                ) from None


def csv_rows(file: Path, required: Iterable[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row by column name) of a CSV file with a header line; a
    missing column, a short row or bad bytes are one-line errors naming the line."""
    import csv

    with file.open(newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        try:
            header = next(reader, None)
            if header is None:
                raise bad_row(file, 1, "empty file: expected a header line")
            header = [h.strip().lstrip("\ufeff") for h in header]
            missing = [c for c in required if c not in header]
            if missing:
                raise bad_row(
                    file, 1, f"missing column {', '.join(map(repr, missing))} (the header has "
                    f"{', '.join(map(repr, header))})",
                )  # fmt: skip
            for values in reader:
                if not values or not any(v.strip() for v in values):
                    continue
                if len(values) != len(header):
                    raise bad_row(
                        file,
                        reader.line_num,
                        f"{len(values)} fields where the header has {len(header)}",
                    )
                yield reader.line_num, dict(zip(header, values))
        except UnicodeDecodeError as err:
            raise bad_row(file, reader.line_num + 1, f"not UTF-8 text ({err.reason})") from None
        except csv.Error as err:
            raise bad_row(file, reader.line_num, f"not valid CSV ({err})") from None


def timed_requests(
    reader: str,
    file: Path,
    rows: list[Row],
    selection: Selection,
    build: RequestBuilder,
    prompt_of: Callable[[Row, int], list[int]] | None = None,
    **extra: Any,
) -> TraceRequests:
    """One request per kept row at its arrival offset, lengths capped; the prompt
    is `prompt_of(row, length)`, by default seeded random tokens (the published
    traces carry lengths, not text)."""
    times = selection.arrivals(rows)
    requests = []
    for index, (row, time) in enumerate(zip(rows, times)):
        input_len, output_len = selection.lengths(row.input_len, row.output_len)
        prompt = prompt_of(row, input_len) if prompt_of else build.random_prompt(input_len)
        requests.append(
            build.request(
                index,
                prompt,
                output_len,
                arrival_time=time,
                request_id=f"{reader}-{row.line}",
                meta={"line": row.line},
            )  # fmt: skip
        )
    return replayed(requests, file, reader, selection, **extra)
