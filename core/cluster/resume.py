"""Continuing a streamed completion on another replica after its replica died.

The proxy relays a stream event by event (never half an event) and `StreamLedger` keeps,
per choice, what the client has been sent: the text's characters, the token ids and the
logprob entries, and whether a chat choice's role chunk went out. A resubmitted request
starts again from its prompt; its stream is passed through the same ledger, which drops
what the client already has and cuts the event that straddles the point reached, so the
client reads one continuous answer. This is exact when the new replica produces the same
tokens: greedy requests (temperature 0) and seeded ones; `resumable` says which. Every
event of a resumed stream carries the first attempt's `id`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# the per-token lists an event may carry in a choice (completions' logprobs lists are
# parallel; a chat choice's logprobs are one `content` list)
_TOKEN_LISTS = (("token_ids",), ("logprobs", "tokens"), ("logprobs", "token_logprobs"),
                ("logprobs", "top_logprobs"), ("logprobs", "text_offset"),
                ("logprobs", "content"))  # fmt: skip


def resumable(body: Mapping[str, Any]) -> bool:
    """Whether the request gives the same tokens when run again from its prompt."""
    temperature = body.get("temperature")
    return body.get("seed") is not None or (
        isinstance(temperature, (int, float)) and temperature == 0
    )


class StreamLedger:
    """Splits raw stream bytes into whole events and accounts for what went out."""

    def __init__(self) -> None:
        self.buffer = b""
        self.sent: dict[int, dict[Any, int]] = {}  # choice -> {"text": chars, path: entries}
        self.roles: set[int] = set()
        self.finished: set[int] = set()  # choices whose finish went out
        self.usage_sent = False  # the closing usage-only event went out
        self.done = False  # `[DONE]` went out: the stream is whole
        self.stream_id: str | None = None
        self.skip: dict[int, dict[Any, int]] = {}  # a resumed attempt: what to drop still
        self.skip_roles: set[int] = set()
        self.skip_finished: set[int] = set()

    @property
    def delivered(self) -> bool:
        """Whether the client has been sent any part of a choice yet."""
        return bool(self.roles) or any(any(v for v in c.values()) for c in self.sent.values())

    def resubmitted(self) -> None:
        """A new attempt starts: everything sent so far is to be skipped in its stream."""
        self.buffer = b""
        self.skip = {i: dict(counts) for i, counts in self.sent.items()}
        self.skip_roles = set(self.roles)
        self.skip_finished = set(self.finished)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The whole events `chunk` completes, as they are to go to the client."""
        self.buffer += chunk
        out = []
        while True:
            end = self.buffer.find(b"\n\n")
            if end < 0:
                return out
            event, self.buffer = self.buffer[: end + 2], self.buffer[end + 2 :]
            kept = self._pass(event)
            if kept is not None:
                out.append(kept)

    def _pass(self, event: bytes) -> bytes | None:
        text = event.decode("utf-8", errors="replace").strip()
        if not text.startswith("data:"):
            return event
        payload = text[5:].strip()
        if payload == "[DONE]":
            if self.done:
                return None
            self.done = True
            return event
        try:
            body = json.loads(payload)
        except ValueError:
            return event
        if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
            return event
        if not body["choices"] and "usage" in body:  # the closing usage event
            if self.usage_sent:
                return None
            self.usage_sent = True
        resumed = bool(self.skip) or bool(self.skip_roles)
        if self.stream_id is None:
            self.stream_id = body.get("id")
        elif "id" in body:
            body["id"] = self.stream_id
        choices = [c for c in (self._choice(c) for c in body["choices"]) if c is not None]
        if body["choices"] and not choices and "usage" not in body:
            return None  # all of it was sent before
        if not resumed and len(choices) == len(body["choices"]):
            return event
        body["choices"] = choices
        return f"data: {json.dumps(body)}\n\n".encode()

    def _choice(self, choice: Any) -> dict | None:
        if not isinstance(choice, dict):
            return choice
        index = choice.get("index", 0)
        if index in self.skip_finished:  # all of this choice went out before
            return None
        sent = self.sent.setdefault(index, {})
        skip = self.skip.get(index, {})
        delta = choice.get("delta")
        holder, key = (delta, "content") if isinstance(delta, dict) else (choice, "text")
        content = holder.get(key) if holder is not None else None
        if isinstance(content, str):
            cut = min(skip.get("text", 0), len(content))
            skip["text"] = skip.get("text", 0) - cut
            holder[key] = content = content[cut:]
            sent["text"] = sent.get("text", 0) + len(content)
        entries = 0
        for path in _TOKEN_LISTS:
            parent = choice
            for part in path[:-1]:
                parent = parent.get(part) if isinstance(parent, dict) else None
            values = parent.get(path[-1]) if isinstance(parent, dict) else None
            if isinstance(values, list):
                cut = min(skip.get(path, 0), len(values))
                parent[path[-1]] = values = values[cut:]
                skip[path] = skip.get(path, 0) - cut
                sent[path] = sent.get(path, 0) + len(values)
                entries += len(values)
        if isinstance(delta, dict) and "role" in delta:
            if index in self.skip_roles:
                del delta["role"]
            else:
                self.roles.add(index)
        finished = choice.get("finish_reason") is not None
        if finished:
            self.finished.add(index)
        if content or entries or finished or (isinstance(delta, dict) and "role" in delta):
            return choice
        return None if index in self.skip or index in self.skip_roles else choice
