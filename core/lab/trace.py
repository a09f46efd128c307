"""The `trace` workload: replays a JSONL file, one request per line, as
written. A trace is never clipped or reordered beyond sorting by arrival time:
a line that cannot be served is a `ConfigError` naming the file, the line and
the problem, so a replay is the trace or nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from servelab.errors import ConfigError
from servelab.lab.request_builder import RequestBuilder, WorkloadRequest
from servelab.step.sequence import finite_number

TRACE_KEYS = (
    "prompt_len",
    "prompt_token_ids",
    "output_len",
    "arrival_time",
    "priority",
    "client",
)


def trace_workload(
    vocab_size: int,
    max_model_len: int | None = None,
    path: str | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
) -> list[WorkloadRequest]:
    """Replays a JSONL trace: one JSON object per line with `prompt_len` or
    `prompt_token_ids`, `output_len`, optional `arrival_time` (seconds, default
    0; multiplied by `time_scale`), `priority` (default 0) and `client` (a
    string, default null: anonymous). Blank lines are
    skipped; a bad line is a `ConfigError` naming the file, the line and the
    problem. Random prompt tokens for `prompt_len` come from `seed`."""
    if not path:
        raise ConfigError(
            "workload trace needs `path`: a JSONL file, e.g. workload.path=trace.jsonl"
        )
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise ConfigError(f"workload trace: no such file {str(file)!r}")
    scale = finite_number(time_scale)
    if scale is None or scale < 0:
        raise ConfigError(
            f"workload trace: time_scale must be a finite number >= 0, got {time_scale!r}"
        )
    build = RequestBuilder(vocab_size, max_model_len, seed, temperature, ignore_eos)
    requests = []
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = file.read_bytes()[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"{file}:{line}: not UTF-8 text (byte {err.object[err.start]:#04x})"
        ) from None
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{file}:{lineno}"
        prompt, output_len, arrival, priority = parse_trace_line(line, where, vocab_size)
        client = trace_client(line, where)
        if isinstance(prompt, int):
            prompt = build.random_prompt(prompt)
        # a trace is replayed as written: too long is an error, never clipped
        if max_model_len is not None and len(prompt) + output_len > max_model_len:
            raise ConfigError(
                f"{where}: prompt ({len(prompt)} tokens) + output_len ({output_len}) exceeds "
                f"max_model_len={max_model_len}"
            )
        requests.append(
            build.request(
                lineno,
                prompt,
                output_len,
                arrival_time=arrival * time_scale,
                priority=priority,
                request_id=f"trace-{lineno}",
                client=client,
            )
        )
    if not requests:
        raise ConfigError(f"workload trace: {file} holds no requests")
    requests.sort(key=lambda r: r.arrival_time)  # stable: file order among equal times
    return requests


def parse_trace_line(
    line: str, where: str, vocab_size: int
) -> tuple[int | list[int], int, float, int]:
    """One trace line -> (prompt length or token ids, output_len, arrival_time, priority)."""

    def no_constant(name: str):  # JSON has no NaN or Infinity; Python's parser accepts them
        raise ConfigError(f"{where}: {name} is not a number JSON allows")

    try:
        item = json.loads(line, parse_constant=no_constant)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(item).__name__}")
    unknown = [k for k in item if k not in TRACE_KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; accepted: {', '.join(TRACE_KEYS)}")
    if ("prompt_len" in item) == ("prompt_token_ids" in item):
        raise ConfigError(f"{where}: give exactly one of prompt_len and prompt_token_ids")

    def positive_int(key: str) -> int:
        value = item.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        return value

    if "prompt_len" in item:
        prompt: int | list[int] = positive_int("prompt_len")
    else:
        ids = item["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            raise ConfigError(f"{where}: prompt_token_ids must be a non-empty list of token ids")
        bad = [
            t
            for t in ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
        ]
        if bad:
            raise ConfigError(
                f"{where}: token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})"
            )
        prompt = ids
    if "output_len" not in item:
        raise ConfigError(f"{where}: missing output_len")
    output_len = positive_int("output_len")
    arrival = item.get("arrival_time", 0.0)
    number = finite_number(arrival)
    if number is None or number < 0:
        raise ConfigError(
            f"{where}: arrival_time must be a finite number >= 0 (seconds), got {arrival!r}"
        )
    priority = item.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ConfigError(f"{where}: priority must be an integer, got {priority!r}")
    return prompt, output_len, number, priority


def trace_client(line: str, where: str) -> str | None:
    """The `client` of a line `parse_trace_line` accepted: a non-empty string or null."""
    client = json.loads(line).get("client")
    if client is not None and (not isinstance(client, str) or client == ""):
        raise ConfigError(f"{where}: client must be a non-empty string or null, got {client!r}")
    return client
