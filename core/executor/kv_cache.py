"""The KV tensors: the device pool every layer reads through block tables, the
host pool swapped blocks (and a host KV tier's) live in, and `apply`, the one
place block copies run.

Layout: one tensor `[2 (k, v), num_layers, num_blocks, block_size,
num_kv_heads, head_dim]`, so one indexed copy moves a block of every layer. `read` and `write` move one
sequence's tokens through its block table (prefill/decode disaggregation).
"""

from __future__ import annotations

import time

import torch

from servelab.kernels import huge_pages
from servelab.step.plan import BlockCopies


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_host_blocks: int = 0,
    ) -> None:
        self.device = device
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: padded backends read masked slots, and 0 * NaN is NaN
        # every decode step streams it: on the CPU, on huge pages
        self.device_pool = huge_pages.zeros(shape, dtype, device)
        host_shape = (2, num_layers, num_host_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda"
        self.host_pool = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.layers = [(self.device_pool[0, i], self.device_pool[1, i]) for i in range(num_layers)]
        self.block_bytes = self.device_pool[:, :, 0].numel() * self.device_pool.element_size()
        self.bytes_swapped_out = 0
        self.bytes_swapped_in = 0
        self.bytes_copied = 0
        self.tier_load_seconds = 0.0  # time running a KV tier's loads
        self.tier_store_seconds = 0.0  # and its stores (a disk tier's writes included)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    def apply(self, copies: BlockCopies) -> None:
        """Runs a step's copies in the only safe order (`BlockCopies`): the reads of
        device blocks (a tier's stores, swap-out) before the writes that may reuse them."""
        if copies.has_tier_copies:
            self._tier_stores(copies)
        if copies.swap_out:
            src, dst = self._index(copies.swap_out, self.device, "cpu")
            staged = self._download(self.device_pool[:, :, src])
            self._wait_for_downloads()  # the host reads `staged` next: its copy must be done
            self.host_pool[:, :, dst] = staged
            self.bytes_swapped_out += len(copies.swap_out) * self.block_bytes
        if copies.tier_in or copies.tier_fetch:
            self._tier_loads(copies)
        if copies.swap_in:
            src, dst = self._index(copies.swap_in, "cpu", self.device)
            self.device_pool[:, :, dst] = self.host_pool[:, :, src].to(
                self.device, non_blocking=True
            )
            self.bytes_swapped_in += len(copies.swap_in) * self.block_bytes
        if copies.copy:
            src, dst = self._index(copies.copy, self.device, self.device)
            self.device_pool[:, :, dst] = self.device_pool[:, :, src]
            self.bytes_copied += len(copies.copy) * self.block_bytes

    # -- a KV tier's copies (servelab.contracts.kv_tier)
    def _tier_stores(self, copies: BlockCopies) -> None:
        start = time.perf_counter()
        if copies.tier_out:
            src, dst = self._index(_last_writes(copies.tier_out), self.device, "cpu")
            staged = self._download(self.device_pool[:, :, src])
            self._wait_for_downloads()
            self.host_pool[:, :, dst] = staged
        if copies.tier_save:
            blocks = [block for block, _ in copies.tier_save]
            index = torch.tensor(blocks, dtype=torch.long, device=self.device)
            staged = self._download(self.device_pool[:, :, index])
            self._wait_for_downloads()
            for i, (_, sink) in enumerate(copies.tier_save):
                sink(staged[:, :, i])
        self.tier_store_seconds += time.perf_counter() - start

    def _tier_loads(self, copies: BlockCopies) -> None:
        start = time.perf_counter()
        if copies.tier_in:
            src, dst = self._index(_last_writes(copies.tier_in), "cpu", self.device)
            self.device_pool[:, :, dst] = self.host_pool[:, :, src].to(self.device)
        if copies.tier_fetch:
            pairs = _last_writes(copies.tier_fetch)
            dst = torch.tensor([block for _, block in pairs], dtype=torch.long, device=self.device)
            kv = torch.stack([source() for source, _ in pairs], dim=2)
            self.device_pool[:, :, dst] = kv.to(self.device, self.device_pool.dtype)
        self._wait_for_downloads()  # so the time is the copies', not their launch
        self.tier_load_seconds += time.perf_counter() - start

    # -- one sequence's tokens: token i at block_table[i // block_size], offset i % block_size
    def token_layout(self, num_tokens: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of `num_tokens` tokens' K/V: [2, num_layers, num_tokens, heads, head_dim]."""
        two, layers, _, _, heads, head_dim = self.device_pool.shape
        return (two, layers, num_tokens, heads, head_dim), self.device_pool.dtype

    def read(self, table: list[int], num_tokens: int) -> torch.Tensor:
        """A copy of a sequence's first `num_tokens` K/V (`token_layout`)."""
        return self._flat_pool()[:, :, self._slots(table, 0, num_tokens)]  # indexing copies

    def write(self, table: list[int], kv: torch.Tensor, start: int, end: int) -> None:
        """Writes tokens [start, end) of `kv` into the sequence's slots."""
        if start < end:
            slots = self._slots(table, start, end)
            self._flat_pool()[:, :, slots] = kv[:, :, start:end].to(self.device)

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        block_size = self.device_pool.shape[3]
        positions = torch.arange(start, end, dtype=torch.long)
        blocks = torch.tensor(table, dtype=torch.long)[positions // block_size]
        return (blocks * block_size + positions % block_size).to(self.device)

    def _flat_pool(self) -> torch.Tensor:
        two, layers, blocks, block_size, heads, head_dim = self.device_pool.shape
        return self.device_pool.view(two, layers, blocks * block_size, heads, head_dim)

    def _download(self, blocks: torch.Tensor) -> torch.Tensor:
        """`blocks` copied into host memory (pinned on CUDA), asynchronously there."""
        if self.device.type == "cpu":
            return blocks  # the gather made it already
        staged = torch.empty(
            blocks.shape, dtype=blocks.dtype, pin_memory=self.device.type == "cuda"
        )
        staged.copy_(blocks, non_blocking=True)
        return staged

    def _wait_for_downloads(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @staticmethod
    def _index(
        pairs: list[tuple[int, int]], src_device, dst_device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src_device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst_device)
        return src, dst


def _last_writes(pairs: list) -> list:
    """`(src, dst)` pairs where a later pair writing the same `dst` replaces an
    earlier one: one indexed assignment with a repeated index keeps an arbitrary one."""
    last = {dst: i for i, (_, dst) in enumerate(pairs)}
    if len(last) == len(pairs):
        return pairs
    return [pairs[i] for i in sorted(last.values())]
