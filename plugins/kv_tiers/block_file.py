"""One KV block as a file: what the `disk` tier writes and reads back.

A file is `MAGIC`, the header's length (4 bytes, little-endian), a JSON header
and the payload (the block's K/V, raw). The header names the model identity
(a digest of `kv_identity`), the block's key and tokens, the payload's dtype,
shape and length, and a sha256 over key, tokens and payload. A file is read as
K/V only when every one of those matches what the lookup asked for; anything
else (a truncated or altered file, another model's or block size's) is a
`BlockFileError` naming the reason. Files are written to a temporary name and
renamed, so a crash leaves no half-written block under a block's name.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

MAGIC = b"SLKVBLK1"
SUFFIX = ".kvblock"


class BlockFileError(Exception):
    """A block file that must not be read as K/V; the message says why."""


def identity_digest(kv_identity: dict[str, Any]) -> str:
    """A short digest of what kept K/V depends on besides its prefix."""
    text = json.dumps(kv_identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_name(key: bytes, identity: str) -> str:
    """`<key>-<identity>.kvblock`: named by the block's chain key and the model identity."""
    return f"{key.hex()}-{identity}{SUFFIX}"


def parse_name(name: str) -> tuple[bytes, str] | None:
    """`(key, identity)` of a block file's name; None for any other name."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[: -len(SUFFIX)]
    key_hex, sep, identity = stem.partition("-")
    if not sep or not identity:
        return None
    try:
        return bytes.fromhex(key_hex), identity
    except ValueError:
        return None


def _checksum(key: bytes, tokens: tuple[int, ...], payload: bytes) -> str:
    digest = hashlib.sha256(key)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    digest.update(payload)
    return digest.hexdigest()


def write_block(
    path: Path, key: bytes, tokens: tuple[int, ...], identity: str, kv: torch.Tensor
) -> int:
    """Writes `kv` (one block's K/V) to `path`; returns the file's size. OSError
    (a full disk, no permission) propagates, and no file is left behind."""
    kv = kv.detach().to("cpu").contiguous()
    payload = kv.reshape(-1).view(torch.uint8).numpy().tobytes()
    header = json.dumps(
        {
            "identity": identity,
            "key": key.hex(),
            "tokens": list(tokens),
            "dtype": str(kv.dtype).removeprefix("torch."),
            "shape": list(kv.shape),
            "payload_bytes": len(payload),
            "sha256": _checksum(key, tokens, payload),
        }
    ).encode()
    data = MAGIC + struct.pack("<I", len(header)) + header + payload
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
        raise
    return len(data)


def read_block(
    path: Path,
    key: bytes,
    tokens: tuple[int, ...],
    identity: str,
    layout: tuple[tuple[int, ...], str] | None = None,
) -> torch.Tensor:
    """The K/V of the block file `path`, checked against what the lookup asked
    for (and `layout`, the `(shape, dtype)` a block must have, when given);
    `BlockFileError` when anything does not match."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BlockFileError(f"cannot be read ({exc.strerror or exc})") from None
    start = len(MAGIC) + 4
    if len(data) < start or data[: len(MAGIC)] != MAGIC:
        raise BlockFileError("is not a servelab KV block file (no magic bytes)")
    (header_len,) = struct.unpack("<I", data[len(MAGIC) : start])
    try:
        header = json.loads(data[start : start + header_len])
        expected = header["payload_bytes"]
        dtype = getattr(torch, header["dtype"])
        shape = [int(n) for n in header["shape"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise BlockFileError("has a damaged header") from None
    if header.get("identity") != identity:
        raise BlockFileError("was written for another model, dtype or block size")
    if header.get("key") != key.hex() or header.get("tokens") != list(tokens):
        raise BlockFileError("holds another prefix's block")
    payload = data[start + header_len :]
    if len(payload) != expected:
        raise BlockFileError(f"is truncated ({len(payload)} of {expected} payload bytes)")
    if header.get("sha256") != _checksum(key, tokens, payload):
        raise BlockFileError("fails its checksum")
    if layout is not None and (tuple(shape), header["dtype"]) != (tuple(layout[0]), layout[1]):
        raise BlockFileError(f"holds K/V of shape {shape} {header['dtype']}, not {layout}")
    try:
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)
    except RuntimeError:
        raise BlockFileError("has a payload that does not fit its dtype and shape") from None
