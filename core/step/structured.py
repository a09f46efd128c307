"""A request's output constraint (structured outputs), as data: which kind and its
specification, checked for shape here (exactly one kind, the right types, a size
limit). Whether the specification itself is valid (a schema xgrammar can build, a
regex that parses, a grammar whose rules exist) is `servelab.model.grammar`'s
check, made when the engine takes the request.

The kinds are vLLM's `StructuredOutputsParams`:
- `json`: a JSON schema (a dict, or its JSON text);
- `json_object`: any JSON object (OpenAI's `response_format={"type": "json_object"}`);
- `regex`: the output matches this regular expression;
- `choice`: the output is exactly one of these strings;
- `grammar`: an EBNF grammar (GBNF, llama.cpp's dialect, as xgrammar reads it), rule `root`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from servelab.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The longest specification taken, in characters: a schema, regex or grammar past it is
# refused before any compiling, so a pathological one cannot hold a compile thread for long.
MAX_SPEC_CHARS = 128 * 1024


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of the fields set. `spec` is its canonical text (the cache key)."""

    json: Any = None  # dict or JSON text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError(
                f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        if self.json is not None:
            spec = self.json
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError as err:
                    raise RequestError(f"structured_outputs.json is not JSON: {err}") from None
            if not isinstance(spec, (dict, bool)):
                raise RequestError("structured_outputs.json must be a JSON schema (an object), "
                                   f"got {type(spec).__name__}")  # fmt: skip
            # keys keep their order: a schema's property order is the output's order
            object.__setattr__(self, "json", json.dumps(spec))
        if self.json_object is not False and self.json_object is not True:
            raise RequestError(f"structured_outputs.json_object must be true or false, "
                               f"got {self.json_object!r}")  # fmt: skip
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"structured_outputs.{name} must be a non-empty string, "
                                   f"got {value!r:.80}")  # fmt: skip
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
                raise RequestError("structured_outputs.choice must be a non-empty list of "
                                   f"strings, got {choice!r:.80}")  # fmt: skip
            if not all(isinstance(c, str) and c for c in choice):
                raise RequestError("structured_outputs.choice must hold non-empty strings, "
                                   f"got {choice!r:.80}")  # fmt: skip
            object.__setattr__(self, "choice", tuple(choice))
        if len(self.spec) > MAX_SPEC_CHARS:
            raise RequestError(
                f"structured_outputs.{self.kind} is {len(self.spec)} characters long; the "
                f"limit is {MAX_SPEC_CHARS}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The specification as one string (a choice's strings as a JSON list)."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return json.dumps(list(value))
        return "" if value is True else value

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputs | None:
        """None, a `StructuredOutputs`, or a dict of its fields (as JSON sends it)."""
        if value is None or isinstance(value, StructuredOutputs):
            return value
        if not isinstance(value, dict):
            raise RequestError("structured_outputs must be an object with one of "
                               f"{', '.join(KINDS)}, got {value!r:.80}")  # fmt: skip
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise RequestError(f"structured_outputs: unknown field {unknown[0]!r}; the fields "
                               f"are {', '.join(KINDS)}")  # fmt: skip
        return cls(**{k: v for k, v in value.items() if v is not None})
