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
`# same code with names changed: a -> new_a, ...`, then the renamed copy's first
line; the model should re-emit the renamed rest. Most of that output is in the
prompt already, which is where n-gram prompt lookup shines.
Prompt + `max_tokens` fits the 512 tokens the models were trained on; no
(file, first line) is used twice in a workload.
"""

from __future__ import annotations

import builtins
import json
import keyword
import random
import re
from collections import Counter
from pathlib import Path

from spec_pair_corpus import SourceFile

MAX_TOKENS = 128
TRAINED_CONTEXT = 512  # the models' training windows: prompt + max_tokens stays within
COMPLETION_PROMPT = (128, 384)
EDIT_CHUNK = (160, 240)
EDIT_COMMENT = "# same code with names changed:"
IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
ATTRIBUTE = re.compile(r"\.\s*([A-Za-z_][A-Za-z0-9_]*)")
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


def code_completion(files: list[SourceFile], tokenizer, count: int, seed: int) -> list[dict]:
    """`count` completion requests (see the module docstring)."""
    rng = random.Random(f"code_completion/{seed}")
    requests: list[dict] = []
    for _ in range(MAX_ATTEMPTS):
        if len(requests) == count:
            return requests
        source, lines, start = _pick(rng, files)
        if not lines[start].strip():
            continue
        found = _line_run(
            lines, start, tokenizer, rng.randint(*COMPLETION_PROMPT), COMPLETION_PROMPT[1]
        )
        if found is None or found[0] >= len(lines):
            continue
        end = found[0]
        prompt = "\n".join(lines[start:end])
        reference = "\n" + "\n".join(lines[end : end + 16])
        request = _request(
            "code_completion",
            len(requests),
            source.path,
            start,
            prompt,
            tokenizer,
            reference=reference,
        )
        if _fits(request, requests):
            requests.append(request)
    raise ValueError(f"found {len(requests)} of {count} completion prompts in the held-out files")


def renames_for(chunk: str, limit: int = 2) -> dict[str, str]:
    """Up to `limit` names of the chunk worth renaming, most frequent first:
    old -> new_old. A name qualifies when it is used at least twice, has 3+
    characters, is no keyword or builtin and never follows a dot (attributes and
    methods belong to other code; renaming them would not be the same program)."""
    counts = Counter(IDENTIFIER.findall(chunk))
    attributes = set(ATTRIBUTE.findall(chunk))
    names = [
        name
        for name, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        if n >= 2
        and len(name) >= 3
        and name not in NOT_RENAMED
        and name not in attributes
        and f"new_{name}" not in counts
    ]
    return {name: f"new_{name}" for name in names[:limit]}


def rename(text: str, renames: dict[str, str]) -> str:
    if not renames:
        return text
    pattern = re.compile(r"(?<![.\w])(" + "|".join(map(re.escape, renames)) + r")\b")
    return pattern.sub(lambda m: renames[m.group(1)], text)


def code_edit(files: list[SourceFile], tokenizer, count: int, seed: int) -> list[dict]:
    """`count` copy-heavy edit requests (see the module docstring)."""
    rng = random.Random(f"code_edit/{seed}")
    requests: list[dict] = []
    for _ in range(MAX_ATTEMPTS):
        if len(requests) == count:
            return requests
        source, lines, start = _pick(rng, files)
        if not lines[start].strip():
            continue
        found = _line_run(lines, start, tokenizer, *EDIT_CHUNK)
        if found is None:
            continue
        chunk_lines = lines[start : found[0]]
        renames = renames_for("\n".join(chunk_lines))
        if not renames or len(chunk_lines) < 3:
            continue
        renamed = [rename(line, renames) for line in chunk_lines]
        listing = ", ".join(f"{old} -> {new}" for old, new in renames.items())
        prompt = "\n".join([*chunk_lines, "", f"{EDIT_COMMENT} {listing}", renamed[0]])
        reference = "\n" + "\n".join(renamed[1:])
        request = _request(
            "code_edit",
            len(requests),
            source.path,
            start,
            prompt,
            tokenizer,
            reference=reference,
            renames=renames,
        )
        if _fits(request, requests):
            requests.append(request)
    raise ValueError(f"found {len(requests)} of {count} edit prompts in the held-out files")


def write_jsonl(path: Path, requests: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for request in requests:
            f.write(json.dumps(request, sort_keys=True) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
