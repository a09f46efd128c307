"""The trained pair's corpus and tokenizer: the Python standard library's own
source, which every machine with Python has offline.

- files: every `*.py` under `sysconfig.get_paths()["stdlib"]`, sorted by path
  relative to it; `site-packages`/`dist-packages` (third-party code, which differs
  between machines) and `__pycache__` are left out;
- split: a file is held out when sha256 of its relative path (POSIX form) falls
  in the first `heldout_percent` of 100 buckets, so the split depends on the
  path alone, not on which other files exist;
- a size cap (`max_bytes`) takes whole files in sorted order until it is
  reached (the quick run's small corpus);
- tokenizer: byte-level BPE (GPT-2's byte alphabet, no prefix space, so
  `decode(encode(text)) == text` for any text) trained with Hugging Face
  `tokenizers` on the training files; `<|endoftext|>` is id 0, the end-of-text
  and eos token, and separates files in the token stream.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

EOS_TOKEN = "<|endoftext|>"
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib folder, POSIX form
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_paths(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the standard library's `*.py` files, sorted."""
    root = root or stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        for name in files:
            if name.endswith(".py"):
                found.append(Path(folder, name).relative_to(root).as_posix())
    return sorted(found)


def is_heldout(path: str, heldout_percent: int) -> bool:
    """Whether `path` is held out: its sha256 bucket (of 100) is below the percentage."""
    bucket = int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:8], "big") % 100
    return bucket < heldout_percent


def read_split(
    heldout_percent: int, max_train_bytes: int | None, max_heldout_bytes: int | None
) -> tuple[list[SourceFile], list[SourceFile]]:
    """(training files, held-out files), each capped in sorted order. Files that
    are not UTF-8 are skipped (a handful of test files carry other encodings)."""
    root = stdlib_root()
    train: list[SourceFile] = []
    heldout: list[SourceFile] = []
    sizes = {"train": 0, "heldout": 0}
    for path in stdlib_paths(root):
        side, files, cap = (
            ("heldout", heldout, max_heldout_bytes)
            if is_heldout(path, heldout_percent)
            else ("train", train, max_train_bytes)
        )
        if cap is not None and sizes[side] >= cap:
            continue
        try:
            text = (root / path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        files.append(SourceFile(path, text))
        sizes[side] += len(text.encode("utf-8"))
    return train, heldout


def train_tokenizer(files: list[SourceFile], vocab_size: int, min_frequency: int = 2):
    """A byte-level BPE `tokenizers.Tokenizer` with `EOS_TOKEN` as id 0 (merges of
    pairs seen at least `min_frequency` times)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((f.text for f in files), trainer, length=len(files))
    return tokenizer


def eos_id(tokenizer) -> int:
    token_id = tokenizer.token_to_id(EOS_TOKEN)
    if token_id is None:
        raise ValueError(f"tokenizer has no {EOS_TOKEN}")
    return token_id


def encode_files(tokenizer, files: list[SourceFile]) -> list[list[int]]:
    """Each file's token ids (batched: `tokenizers` encodes on every core)."""
    return [
        e.ids for e in tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    ]


def token_stream(encoded: list[list[int]], eos: int) -> torch.Tensor:
    """The files' ids one after another, each followed by eos: int64 [N]."""
    flat: list[int] = []
    for ids in encoded:
        flat.extend(ids)
        flat.append(eos)
    return torch.tensor(flat, dtype=torch.int64)
