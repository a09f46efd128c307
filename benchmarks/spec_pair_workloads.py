"""The trained pair's two workloads, cut from held-out files of the corpus.

Each is a JSON-lines file, one request a line:

    {"id": "code_completion-007", "source": "json/decoder.py", "start_line": 41,
     "prompt": "...", "prompt_token_ids": [...], "max_tokens": 128,
     "reference": "...", "renames": {}}

- `prompt_token_ids` is `tokenizer.encode(prompt)` (authoritative; the text is
  for people and for engines that take text);
- `source` and `start_line` (0-based) say where the prompt's first line is;
- `reference` is what the source says next (code_completion: the file's next
  lines; code_edit: the rest of the renamed copy), for reading, not scoring;
- `renames` (code_edit only): the identifiers the edit renames, old -> new.

code_completion: a run of whole lines of a held-out file, ending at the end of
a line (without its newline, so the prompt stops at a natural token boundary
and the model's first token is the newline and indentation), 128-384 tokens.
code_edit: a run of lines (160-240 tokens), then a blank line, the comment
`# same code with names changed: a -> new_a, ...` (one or two names of the
chunk's code, renamed in code only), then the renamed copy's first line; the
model should re-emit the renamed rest. Most of that output is in the
prompt already, which is where n-gram prompt lookup shines.
Prompt + `max_tokens` fits the 512 tokens the models were trained on; no
(file, first line) is used twice in a workload.
"""

from __future__ import annotations

import builtins
import io
import json
import keyword
import random
import tokenize
from collections import Counter
from pathlib import Path

from spec_pair_corpus import SourceFile

WORKLOADS_VERSION = 3  # bump when the requests change: cached runs rewrite their workloads
MAX_TOKENS = 128
TRAINED_CONTEXT = 512  # the models' training windows: prompt + max_tokens stays within
COMPLETION_PROMPT = (128, 384)
EDIT_CHUNK = (160, 240)
EDIT_COMMENT = "# same code with names changed:"
LAYOUT_TOKENS = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT)
NOT_RENAMED = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}
MAX_ATTEMPTS = 10_000


def _lines(text: str) -> list[str]:
    return text.split("\n")


def _line_run(
    lines: list[str], start: int, tokenizer, lo: int, hi: int
) -> tuple[int, list[int]] | None:
    """(end, ids): the shortest run lines[start:end] (joined, no final newline)
    of at least `lo` tokens, if it has at most `hi`; None otherwise."""
    for end in range(start + 1, len(lines) + 1):
        text = "\n".join(lines[start:end])
        if not text.strip():
            continue
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) >= lo:
            return (end, ids) if len(ids) <= hi else None
    return None


def _request(
    kind: str, index: int, source: str, start: int, prompt: str, tokenizer, **extra
) -> dict:
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    return {
        "id": f"{kind}-{index:03d}",
        "source": source,
        "start_line": start,
        "prompt": prompt,
        "prompt_token_ids": ids,
        "max_tokens": MAX_TOKENS,
        "reference": extra.get("reference", ""),
        "renames": extra.get("renames", {}),
    }


def _pick(rng: random.Random, files: list[SourceFile]) -> tuple[SourceFile, list[str], int]:
    source = files[rng.randrange(len(files))]
    lines = _lines(source.text)
    return source, lines, rng.randrange(len(lines))


def _fits(request: dict, requests: list[dict]) -> bool:
    """Whether the request fits the trained context and starts where none before did."""
    if len(request["prompt_token_ids"]) + request["max_tokens"] > TRAINED_CONTEXT:
        return False
    return all(
        (r["source"], r["start_line"]) != (request["source"], request["start_line"])
        for r in requests
    )


def _collect(kind: str, what: str, files: list[SourceFile], tokenizer, count: int, seed: int,
             make) -> list[dict]:  # fmt: skip
    """`count` requests of `kind`: start lines drawn from `files` by a generator seeded
    with (kind, seed), each turned into (prompt, extras of `_request`) by `make(rng,
    lines, start)` or skipped (None); a request that does not `_fits` is dropped."""
    rng = random.Random(f"{kind}/{seed}")
    requests: list[dict] = []
    for _ in range(MAX_ATTEMPTS):
        if len(requests) == count:
            return requests
        source, lines, start = _pick(rng, files)
        if not lines[start].strip():
            continue
        made = make(rng, lines, start)
        if made is None:
            continue
        prompt, extra = made
        request = _request(kind, len(requests), source.path, start, prompt, tokenizer, **extra)
        if _fits(request, requests):
            requests.append(request)
    raise ValueError(f"found {len(requests)} of {count} {what} prompts in the held-out files")


def code_completion(files: list[SourceFile], tokenizer, count: int, seed: int) -> list[dict]:
    """`count` completion requests (see the module docstring)."""

    def make(rng: random.Random, lines: list[str], start: int):
        found = _line_run(
            lines, start, tokenizer, rng.randint(*COMPLETION_PROMPT), COMPLETION_PROMPT[1]
        )
        if found is None or found[0] >= len(lines):
            return None
        end = found[0]
        prompt = "\n".join(lines[start:end])
        return prompt, {"reference": "\n" + "\n".join(lines[end : end + 16])}

    return _collect("code_completion", "completion", files, tokenizer, count, seed, make)


def code_names(chunk: str) -> list[tuple[int, int, str]] | None:
    """(line, column, name) of every bare name in the chunk's code: Python NAME
    tokens that are no keyword and do not follow a dot (attributes and methods
    belong to other code), nor any word in a string or a comment. None when the
    chunk does not tokenize (it cuts a string in two, or dedents past its start)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(chunk + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    found: list[tuple[int, int, str]] = []
    previous = None
    for token in tokens:
        if token.type in LAYOUT_TOKENS:
            continue
        after_dot = previous is not None and previous.string == "."
        if token.type == tokenize.NAME and not after_dot and not keyword.iskeyword(token.string):
            found.append((token.start[0] - 1, token.start[1], token.string))
        previous = token
    return found


def renames_for(names: list[tuple[int, int, str]], limit: int = 2) -> dict[str, str]:
    """Up to `limit` of the chunk's bare names worth renaming, most frequent
    first: old -> new_old. A name qualifies when it is used at least twice, has 3+
    characters and is no builtin, `self` or `cls`."""
    counts = Counter(name for _, _, name in names)
    chosen = [
        name
        for name, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        if n >= 2 and len(name) >= 3 and name not in NOT_RENAMED and f"new_{name}" not in counts
    ]
    return {name: f"new_{name}" for name in chosen[:limit]}


def rename(
    lines: list[str], names: list[tuple[int, int, str]], renames: dict[str, str]
) -> list[str]:
    """The lines with each listed occurrence of a renamed name replaced."""
    renamed = list(lines)
    for row, column, name in sorted(names, reverse=True):  # right to left within a line
        if name in renames:
            line = renamed[row]
            renamed[row] = line[:column] + renames[name] + line[column + len(name) :]
    return renamed


def code_edit(files: list[SourceFile], tokenizer, count: int, seed: int) -> list[dict]:
    """`count` copy-heavy edit requests (see the module docstring)."""

    def make(rng: random.Random, lines: list[str], start: int):
        found = _line_run(lines, start, tokenizer, *EDIT_CHUNK)
        if found is None:
            return None
        chunk_lines = lines[start : found[0]]
        names = code_names("\n".join(chunk_lines))
        renames = renames_for(names or [])
        if names is None or not renames or len(chunk_lines) < 3:
            return None
        renamed = rename(chunk_lines, names, renames)
        listing = ", ".join(f"{old} -> {new}" for old, new in renames.items())
        prompt = "\n".join([*chunk_lines, "", f"{EDIT_COMMENT} {listing}", renamed[0]])
        return prompt, {"reference": "\n" + "\n".join(renamed[1:]), "renames": renames}

    return _collect("code_edit", "edit", files, tokenizer, count, seed, make)


def write_jsonl(path: Path, requests: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for request in requests:
            f.write(json.dumps(request, sort_keys=True) + "\n")


def write_trace(path: Path, requests: list[dict]) -> None:
    """The requests as servelab's `trace` workload reads them (`workload=trace`):
    `prompt_token_ids` and `output_len` (all arriving at once)."""
    write_jsonl(path, [{"prompt_token_ids": r["prompt_token_ids"], "output_len": r["max_tokens"]}
                       for r in requests])  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
