"""The `mooncake` workload: replays a Mooncake trace (kvcache-ai/Mooncake,
FAST25-release/traces), JSONL with one request per line: `timestamp` (ms since
the trace began), `input_length`, `output_length` and `hash_ids`, one id per
`block_size`-token block of the prompt (512 in the published traces), equal ids
meaning identical blocks (an id stands for the block and everything before it).

The trace has no text, so prompts are synthesised to keep exactly its reuse:
hash id h is one fixed block of `block_size` seeded random tokens (from `seed`
and h alone), and a prompt is its ids' blocks in order, cut to `input_length`
(a last, partial block is the first tokens of its id's block). Tokens past the
blocks the ids cover (a prompt longer than they are) are random to the request.
Two prompts that share their first k ids thus share exactly their first
k * block_size tokens, and a prefix cache sees the trace's real reuse.
Selection, time scale, rate rescale and caps (a capped prompt keeps its
beginning): common.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from servelab.errors import ConfigError
from servelab.lab.public_traces.common import (
    Row,
    TraceRequests,
    bad_row,
    count,
    numbered_lines,
    open_trace,
    seconds,
    timed_requests,
)
from servelab.lab.request_builder import FIRST_TOKEN_ID, check_int

KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


def mooncake_workload(
    vocab_size: int,
    max_model_len: int | None = None,
    path: str | None = None,
    block_size: int = 512,
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
    """A Mooncake JSONL trace -> requests whose prompts share what their hash ids share."""
    check_int("workload mooncake: block_size", block_size, 1)
    check_int("workload mooncake: seed", seed, 0)
    file, selection, build = open_trace("mooncake", locals(), "conversation_trace.jsonl")
    rows = selection.select(mooncake_rows(file))
    blocks = HashedBlocks(block_size, vocab_size, seed)
    return timed_requests(
        "mooncake", file, rows, selection, build,
        prompt_of=lambda row, length: blocks.prompt(row.extra, length, row.line),
        block_size=block_size,
    )  # fmt: skip


class HashedBlocks:
    """The token block of each hash id, drawn once from (seed, id)."""

    def __init__(self, block_size: int, vocab_size: int, seed: int) -> None:
        if vocab_size <= FIRST_TOKEN_ID:
            raise ConfigError(f"workload mooncake: vocab_size {vocab_size} leaves no token to draw")
        self.block_size, self.vocab_size, self.seed = block_size, vocab_size, seed
        self.blocks: dict[int, list[int]] = {}

    def _draw(self, *key: int, size: int) -> list[int]:
        rng = np.random.default_rng([self.seed, *key])
        return rng.integers(FIRST_TOKEN_ID, self.vocab_size, size=size).tolist()

    def block(self, hash_id: int) -> list[int]:
        if hash_id not in self.blocks:
            self.blocks[hash_id] = self._draw(0, hash_id, size=self.block_size)
        return self.blocks[hash_id]

    def prompt(self, hash_ids: list[int], length: int, line: int) -> list[int]:
        """`length` tokens: the ids' blocks in order, then tokens of this request alone."""
        tokens: list[int] = []
        for hash_id in hash_ids:
            if len(tokens) >= length:
                break
            tokens += self.block(hash_id)
        if len(tokens) < length:
            tokens += self._draw(1, line, size=length - len(tokens))
        return tokens[:length]


def mooncake_rows(file: Path) -> Iterator[Row]:
    for line, text in numbered_lines(file):
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except json.JSONDecodeError as err:
            raise bad_row(file, line, f"not valid JSON ({err.msg})") from None
        if not isinstance(item, dict):
            raise bad_row(file, line, f"expected a JSON object, got {type(item).__name__}")
        missing = [k for k in KEYS if k not in item]
        if missing:
            raise bad_row(file, line, f"missing key {', '.join(map(repr, missing))}")
        hash_ids = item["hash_ids"]
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
        ):
            raise bad_row(file, line, f"hash_ids is not a list of integers >= 0: {hash_ids!r}")
        yield Row(
            line,
            seconds(file, line, "timestamp", item["timestamp"], unit=1e-3),
            count(file, line, "input_length", item["input_length"]),
            count(file, line, "output_length", item["output_length"]),
            extra=hash_ids,
        )
