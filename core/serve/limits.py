"""The bounds that keep one request from hurting the others, applied before any
costly work: the body's size and arrival time, prompt lengths before tokenizing
(and before checking each token id), stop lists and logit_bias sizes.

Text is tokenized on a worker thread, by a call that releases the GIL, never on the
event loop (a long prompt would stall every stream) and never on the engine thread
(it would stall every step).
No token's text is longer than the tokenizer's longest (`longest_token_chars`), so a
text longer than `max_model_len` times that has more than `max_model_len` tokens,
whatever they are: it is refused without tokenizing.
"""

from __future__ import annotations

import asyncio
import time

from servelab.serve.protocol import ApiError


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token's text has, in any context: its
    longest vocabulary entry. A decoder only maps an entry to at most as many
    characters as it has (a byte-level entry has one character per byte, and no
    UTF-8 character is shorter than a byte; a metaspace or WordPiece entry loses
    its marker; a byte-fallback entry like `<0xE4>` becomes one character), so
    no text is longer per token than this, without decoding the whole vocabulary."""
    if tokenizer is None:
        return 1
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(map(len, vocab), default=1) or 1


async def read_body(request, max_bytes: int, timeout: float) -> bytes:
    """The request body: 413 past `max_bytes` (declared or received), 408 when it has
    not all arrived within `timeout` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body has {declared} bytes, more than the limit "
                       f"of {max_bytes} (serve.max_body_bytes)")  # fmt: skip
    chunks, size = [], 0
    deadline = time.monotonic() + timeout
    stream = request.stream().__aiter__()
    while True:
        left = deadline - time.monotonic()
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), max(left, 0.001))
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout:g} s "
                           "(serve.body_timeout)") from None  # fmt: skip
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body is larger than the limit of {max_bytes} "
                           "bytes (serve.max_body_bytes)")  # fmt: skip
        chunks.append(chunk)
    return b"".join(chunks)


class PromptChecker:
    """Prompts to token ids, each bound checked before the work it guards."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * longest_token_chars(tokenizer)

    def check_text(self, text: str, field: str) -> None:
        if len(text) > self.max_chars:
            raise ApiError(400, f"{field} has {len(text)} characters: more than max_model_len="
                           f"{self.max_model_len} tokens of this tokenizer can hold", field)  # fmt: skip

    async def token_ids(self, prompt, field: str, add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send token ids", field)
            self.check_text(prompt, field)
            # encode_batch releases the GIL while it works (encode holds it: the event
            # loop would stall even with the call on another thread)
            encoded = await asyncio.to_thread(
                self.tokenizer.encode_batch, [prompt], add_special_tokens=add_special_tokens
            )
            ids = encoded[0].ids
        else:
            ids = prompt
        if not ids:
            raise ApiError(400, f"{field} is empty", field)
        if len(ids) >= self.max_model_len:  # before looking at each id
            raise ApiError(400, f"{field} has {len(ids)} tokens: max_model_len="
                           f"{self.max_model_len} leaves no room for output", field)  # fmt: skip
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ApiError(400, f"{field} has a token id outside the vocabulary "
                           f"[0, {self.vocab_size})", field)  # fmt: skip
        return list(ids)


def check_sizes(req, options: dict, vocab_size: int) -> None:
    """Counts and lengths of the request's lists, against the serve options."""
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > options["max_stop"]:
        raise ApiError(400, f"stop has {len(stops)} strings, more than serve.max_stop="
                       f"{options['max_stop']}", "stop")  # fmt: skip
    longest = max((len(s) for s in stops), default=0)
    if longest > options["max_stop_chars"]:
        raise ApiError(400, f"a stop string has {longest} characters, more than "
                       f"serve.max_stop_chars={options['max_stop_chars']}", "stop")  # fmt: skip
    ids = req.stop_token_ids or []
    if len(ids) > options["max_stop_token_ids"]:
        raise ApiError(400, f"stop_token_ids has {len(ids)} ids, more than "
                       f"serve.max_stop_token_ids={options['max_stop_token_ids']}",
                       "stop_token_ids")  # fmt: skip
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ApiError(400, f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    bias = req.logit_bias or {}
    if len(bias) > options["max_logit_bias"]:
        raise ApiError(400, f"logit_bias has {len(bias)} entries, more than "
                       f"serve.max_logit_bias={options['max_logit_bias']}", "logit_bias")  # fmt: skip
    for key in bias:
        if not (key.isdigit() and int(key) < vocab_size):
            raise ApiError(400, f"logit_bias key {key!r:.40} is not a token id in "
                           f"[0, {vocab_size})", "logit_bias")  # fmt: skip


def output_budget(requested: int | None, prompt_len: int, max_model_len: int,
                  default: int | None) -> int:  # fmt: skip
    """vLLM's max_tokens rule: above max_model_len is a 400; None is `default` (None:
    the rest of the context); prompt plus max_tokens past the context is capped (the
    request then ends with finish reason `length` at the context's end)."""
    if requested is not None and requested > max_model_len:
        raise ApiError(400, f"max_tokens={requested} is more than max_model_len="
                       f"{max_model_len}", "max_tokens")  # fmt: skip
    if requested is not None and requested < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {requested}", "max_tokens")
    room = max_model_len - prompt_len
    wanted = requested if requested is not None else (default or room)
    return max(1, min(wanted, room))
