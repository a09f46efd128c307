"""The `sharegpt` workload: prompts from ShareGPT conversations (a JSON list of
`{"id": ..., "conversations": [{"from": "human" | "gpt", "value": text}, ...]}`,
as in ShareGPT_V3_unfiltered_cleaned_split.json). Each human turn followed by a
reply is one request: its prompt is every earlier message of the conversation
then the human message, its output length the reply's token count (`turns: 1`
keeps each conversation's first exchange only, as vLLM's benchmark does).
Roles `human` and `user` ask; any other role (`gpt`, `chatgpt`, `bing`,
`system`...) is history. Tokens: with `tokenizer` (a tokenizer.json, or a
model folder holding one; the preset default is the model's folder) each
message is encoded on its own and the prompt is their concatenation, so a later
turn's prompt starts with the earlier one's. Without one (the named tiny
models) each word or punctuation mark is one token, its id fixed by the text
(FIRST_TOKEN_ID + crc32(piece) mod the rest of the vocabulary), so equal text
gives equal tokens. ShareGPT has no times: conversations start at the times of
`arrival` (`all_at_once` | `poisson` | `gamma`, `rate`, `cv`, seeded by `seed`);
open loop, a conversation's turns arrive with it; with `closed_loop` each later
turn is sent `think_time` s after the previous reply, its history holding the
reply the model generated (servelab.lab.arrivals). Caps (common.py): open loop,
a long prompt keeps its beginning; closed loop, a turn whose prompt would exceed
the cap ends its conversation (counted as `dropped_turns`).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from servelab.errors import ConfigError
from servelab.lab.distributions import arrival_times
from servelab.lab.public_traces.common import (
    Selection,
    TraceRequests,
    bad_row,
    replayed,
    trace_file,
)
from servelab.lab.request_builder import FIRST_TOKEN_ID, RequestBuilder, WorkloadRequest

ASKING = ("human", "user")
WORD_PIECES = re.compile(r"\w+|[^\w\s]")


def sharegpt_workload(
    vocab_size: int,
    max_model_len: int | None = None,
    path: str | None = None,
    tokenizer: str | None = None,
    turns: int | None = None,
    closed_loop: bool = False,
    think_time: float = 0.0,
    arrival: str = "all_at_once",
    rate: float = 8.0,
    cv: float = 1.0,
    first_row: int = 0,
    num_requests: int | None = None,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
) -> TraceRequests:
    """ShareGPT conversations -> requests (module docstring). `first_row` skips
    conversations; `num_requests` counts requests (turns)."""
    file = trace_file(path, "sharegpt", "ShareGPT_V3_unfiltered_cleaned_split.json")
    if turns is not None and not (isinstance(turns, int) and turns >= 1):
        raise ConfigError(
            f"workload sharegpt: turns must be an integer >= 1 or null, got {turns!r}"
        )
    if not isinstance(think_time, int | float) or think_time < 0:
        raise ConfigError(f"workload sharegpt: think_time must be >= 0 seconds, got {think_time!r}")
    selection = Selection(first_row=first_row, num_requests=num_requests,
                          max_input_len=max_input_len, max_output_len=max_output_len,
                          max_model_len=max_model_len)  # fmt: skip
    selection.stats.update(conversations=0, dropped_turns=0)
    encode, tokenized_by = token_encoder(tokenizer, vocab_size)
    build = RequestBuilder(vocab_size, max_model_len, seed, temperature, ignore_eos)
    chats: list[list[WorkloadRequest]] = []
    total = 0
    for index, (line, item) in enumerate(conversations(file)):
        selection.stats["rows_read"] = index + 1  # conversations read
        if index < first_row:
            continue
        if num_requests is not None and total >= num_requests:
            break
        budget = None if num_requests is None else num_requests - total
        chat = conversation(file, line, item, encode, build, selection, turns, budget,
                            closed_loop, float(think_time), len(chats))  # fmt: skip
        if chat:
            chats.append(chat)
            total += len(chat)
    selection.stats["conversations"] = len(chats)
    starts = arrival_times(len(chats), arrival, rate, cv, build.rng)
    for start, chat in zip(starts, chats):
        for req in chat:
            if req.after is None:
                req.arrival_time = float(start)
    requests = [req for chat in chats for req in chat]
    return replayed(requests, file, "sharegpt", selection, tokenized_by=tokenized_by)


def conversation(file, line, item, encode, build, selection, turns, budget, closed_loop,
                 think_time, number) -> list[WorkloadRequest]:  # fmt: skip
    """The requests of one conversation, in turn order."""
    messages = item.get("conversations") if isinstance(item, dict) else None
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("from"), str) and isinstance(m.get("value"), str)
        for m in messages
    ):
        raise bad_row(file, line, 'a conversation must be {"id", "conversations": '
                      '[{"from": ..., "value": text}, ...]}')  # fmt: skip
    history: list[int] = []
    out: list[WorkloadRequest] = []
    k = 0
    while k < len(messages):
        message, tokens = messages[k], encode(messages[k]["value"])
        reply = messages[k + 1] if k + 1 < len(messages) else None
        asks = message["from"] in ASKING and reply is not None and reply["from"] not in ASKING
        k += 1
        if not asks or (turns is not None and len(out) >= turns) or len(out) == budget:
            history += tokens
            continue
        k += 1  # the reply is this request's output, then history
        prompt, answer = history + tokens, encode(reply["value"])
        if not prompt or not answer:
            selection.stats["skipped_zero_length"] += 1
            history = prompt + answer
            continue
        if closed_loop and out and len(prompt) > selection.input_cap():
            selection.stats["dropped_turns"] += 1  # not served capped: the chat ends here
            break
        input_len, output_len = selection.lengths(len(prompt), len(answer))
        name = f"sharegpt-{number}-{len(out)}"
        if closed_loop and out:  # the runner puts the previous prompt and reply in front
            req = build.request(number, tokens, output_len, arrival_time=think_time,
                                request_id=name, after=out[-1].request_id, continues=True)  # fmt: skip
        else:
            req = build.request(number, prompt[:input_len], output_len, request_id=name)
        req.meta = {"line": line, "conversation": item.get("id"), "turn": len(out)}
        out.append(req)
        # closed loop, the next turn's history holds the reply as generated: output_len tokens
        history = prompt + (answer if not closed_loop else [0] * output_len)
    return out


def conversations(file: Path) -> Iterator[tuple[int, object]]:
    """(line, item) of each element of the file's top-level JSON list, read one by one."""
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = file.read_bytes()[: err.start].count(b"\n") + 1
        raise bad_row(file, line, f"not UTF-8 text (byte {err.object[err.start]:#04x})") from None
    decoder = json.JSONDecoder()
    skip = re.compile(r"\s*")
    pos = skip.match(text, 0).end()
    if not text.startswith("[", pos):
        raise bad_row(file, text.count("\n", 0, pos) + 1, "expected a JSON list of conversations")
    pos = skip.match(text, pos + 1).end()
    line, counted = 1, 0
    while not text.startswith("]", pos):
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise bad_row(file, err.lineno, f"not valid JSON ({err.msg})") from None
        yield line, item
        pos = skip.match(text, pos).end()
        if text.startswith(",", pos):
            pos = skip.match(text, pos + 1).end()
        elif not text.startswith("]", pos):
            where = text.count("\n", 0, pos) + 1
            raise bad_row(file, where, "not valid JSON (expected ',' or ']' after a conversation)")


def token_encoder(tokenizer: str | None, vocab_size: int) -> tuple[Callable[[str], list[int]], str]:
    """text -> token ids, and what tokenized it (for the provenance)."""
    source = None if tokenizer is None else Path(str(tokenizer)).expanduser()
    if source is not None and source.is_dir():
        source = source / "tokenizer.json" if (source / "tokenizer.json").is_file() else None
    if source is None:
        span = vocab_size - FIRST_TOKEN_ID

        def by_words(text: str) -> list[int]:
            pieces = WORD_PIECES.findall(text)
            return [FIRST_TOKEN_ID + zlib.crc32(p.encode()) % span for p in pieces]

        return by_words, "one token per word or punctuation mark"
    if not source.is_file():
        raise ConfigError(f"workload sharegpt: no such tokenizer {str(source)!r}")
    from tokenizers import Tokenizer

    try:
        model = Tokenizer.from_file(str(source))
    except Exception as err:  # tokenizers raises its own Exception type
        raise ConfigError(f"{source}: not a readable tokenizer ({err})") from None

    def by_tokenizer(text: str) -> list[int]:
        ids = model.encode(text, add_special_tokens=False).ids
        if ids and max(ids) >= vocab_size:
            raise ConfigError(f"{source}: token id {max(ids)} is outside the model's vocabulary")
        return ids

    return by_tokenizer, str(source)
