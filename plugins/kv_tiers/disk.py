"""`disk`: prefix blocks kept in a folder, one checksummed file per block
(`block_file`), least recently used out first (LMCache's local disk, SGLang's
HiCache storage).

A file is named by the block's chain key and the model identity, so a server
restarted on the same folder starts warm, and blocks another model, dtype or
block size wrote there are never read (one warning at start counts them). A
file is read and checked when a lookup hits it, while the step is planned: a
truncated, altered or foreign file is removed and its block computed instead,
with one warning each. A write that fails (a full disk) drops that block, with
one warning for the first such failure. By default a block is written as soon
as it is computed (`policy: write_through`), so what a server computed
survives it; `write_back` writes only what the device cache evicts. A block
queued for writing is found from the next step on. `capacity_blocks` or
`capacity_bytes` bound the folder's blocks; null: only the disk does. Without
K/V tensors (a simulated executor) only the bookkeeping runs: no file is read
or written.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.kv_tier import DEFAULT_FOLDER, KVTier
from servelab.errors import ConfigError
from servelab.plugins.kv_tiers.block_file import (
    BlockFileError,
    file_name,
    identity_digest,
    parse_name,
    read_block,
    write_block,
)
from servelab.plugins.kv_tiers.options import capacity_of, write_through
from servelab.step.plan import BlockCopies

log = logging.getLogger(__name__)


class DiskTier(KVTier):
    description = "a folder, one checksummed file per block: a restarted server starts warm; LRU"

    def __init__(
        self,
        block_bytes: int,
        kv_identity: dict[str, Any],
        payloads: bool,
        path: str = DEFAULT_FOLDER,
        capacity_blocks: int | None = None,
        capacity_bytes: int | str | None = None,
        policy: str = "write_through",
    ) -> None:
        super().__init__(block_bytes, kv_identity, payloads)
        self.write_through = write_through("disk", policy)
        self.capacity = capacity_of("disk", capacity_blocks, capacity_bytes, block_bytes)
        self.identity = identity_digest(self.kv_identity)
        self.layout = block_layout(self.kv_identity)
        self.folder = _folder(path) if payloads else Path(str(path))
        self.index: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.pending: set[bytes] = set()  # queued for writing: not loadable yet
        self.copies = BlockCopies()
        self.write_failed = False  # the first failed write is logged, the rest counted
        if payloads:
            self._scan()

    # -- the folder at start
    def _scan(self) -> None:
        """Indexes this identity's blocks, oldest first; counts (and warns of) others'."""
        mine, foreign = [], 0
        for entry in os.scandir(self.folder):
            parsed = parse_name(entry.name) if entry.is_file() else None
            if parsed is None:
                continue
            key, identity = parsed
            if identity == self.identity:
                mine.append((entry.stat().st_mtime, key))
            else:
                foreign += 1
        for _, key in sorted(mine):
            self.index[key] = None
        if foreign:
            log.warning(
                "kv_tier disk: %s holds %d block files written for another model, dtype or "
                "block size; they are not read (this engine's are named *-%s%s)",
                self.folder,
                foreign,
                self.identity,
                ".kvblock",
            )
        while self.capacity is not None and len(self.index) > self.capacity:
            self._evict_one()

    # -- lookups and loads
    def holds(self, key: bytes) -> bool:
        return key in self.index and key not in self.pending

    def load(self, key: bytes, tokens: tuple[int, ...], block: int) -> bool:
        if not self.holds(key):
            return False
        kv = None
        if self.payloads:
            start = time.perf_counter()
            path = self._path(key)
            try:
                kv = read_block(path, key, tokens, self.identity, self.layout)
            except BlockFileError as exc:
                log.warning(
                    "kv_tier disk: %s %s; it is removed and its block computed instead",
                    path,
                    exc,
                )
                del self.index[key]
                path.unlink(missing_ok=True)
                self.figures.load_failures += 1
                return False
            finally:
                self.figures.read_seconds += time.perf_counter() - start
        self.index.move_to_end(key)
        self.copies.tier_fetch.append((_Staged(kv), block))
        self.figures.hit(self.block_size, self.block_bytes)
        return True

    # -- stores and room
    def store(self, key: bytes, tokens: tuple[int, ...], block: int) -> None:
        if key in self.index:
            self.index.move_to_end(key)
            return
        while self.capacity is not None and len(self.index) >= self.capacity:
            self._evict_one()
        self.index[key] = None
        self.pending.add(key)
        self.copies.tier_save.append((block, _Writer(self, key, tokens)))
        self.figures.blocks_stored += 1
        self.figures.bytes_stored += self.block_bytes

    def write(self, key: bytes, tokens: tuple[int, ...], kv: Any) -> None:
        """The executor hands over a queued block's K/V: its file is written now."""
        self.pending.discard(key)
        if key not in self.index:  # evicted before it was written
            return
        path = self._path(key)
        try:
            write_block(path, key, tokens, self.identity, kv)
        except OSError as exc:
            del self.index[key]
            self.figures.blocks_dropped += 1
            if not self.write_failed:
                self.write_failed = True
                log.warning(
                    "kv_tier disk: cannot write %s (%s); a block that cannot be written is "
                    "not kept and will be computed again (further failures are counted in "
                    "tier_blocks_dropped, not logged)",
                    path,
                    exc.strerror or exc,
                )

    def _evict_one(self) -> None:
        key, _ = self.index.popitem(last=False)
        self.figures.blocks_evicted += 1
        if key in self.pending:
            self.pending.discard(key)  # its write finds it gone and skips
        elif self.payloads:
            self._path(key).unlink(missing_ok=True)

    def _path(self, key: bytes) -> Path:
        return self.folder / file_name(key, self.identity)

    # -- copies and figures
    def take_copies(self) -> BlockCopies:
        copies, self.copies = self.copies, BlockCopies()
        if not self.payloads:  # no file to wait for: loadable as a written one would be
            self.pending.clear()
        return copies

    def stats(self) -> dict[str, float]:
        return super().stats() | {"disk_blocks": len(self.index)}

    def check_integrity(self) -> None:
        """Pending writes are indexed; the index is within capacity."""
        assert self.pending <= self.index.keys(), "a pending write is not indexed"
        if self.capacity is not None:
            assert len(self.index) <= self.capacity, "the disk tier exceeds its capacity"


class _Writer:
    """A queued block's sink: the executor calls it with the block's K/V."""

    __slots__ = ("tier", "key", "tokens")

    def __init__(self, tier: DiskTier, key: bytes, tokens: tuple[int, ...]) -> None:
        self.tier, self.key, self.tokens = tier, key, tokens

    def __call__(self, kv: Any) -> None:
        self.tier.write(self.key, self.tokens, kv)


class _Staged:
    """A loaded block's source: the K/V read (and checked) when the lookup hit."""

    __slots__ = ("kv",)

    def __init__(self, kv: Any) -> None:
        self.kv = kv

    def __call__(self) -> Any:
        return self.kv


def block_layout(kv_identity: dict[str, Any]) -> tuple[tuple[int, ...], str] | None:
    """The shape and dtype one block's K/V has (`KVCache`'s layout), from the
    identity; None when the identity does not say (a tier built outside an engine)."""
    names = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
    if not all(n in kv_identity for n in names):
        return None
    layers, size, heads, dim, dtype = (kv_identity[n] for n in names)
    return (2, layers, size, heads, dim), str(dtype)


def _folder(path: str) -> Path:
    """The tier's folder, made if missing; a ConfigError when it cannot be used."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"kv_tier 'disk': path must name a folder, got {path!r}")
    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"kv_tier 'disk': cannot make the folder {str(folder)!r} ({exc.strerror or exc})"
        ) from None
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"kv_tier 'disk': {str(folder)!r} is not a writable folder")
    return folder


@hookimpl
def servelab_register_kv_tiers():
    return {"disk": DiskTier}
