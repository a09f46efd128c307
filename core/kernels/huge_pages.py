"""CPU tensors on 2 MiB pages (Linux transparent huge pages), for what a decode
step streams: the weights and the KV cache it attends over.

A decode step at a few rows is a stream of every weight, so the memory's read rate
sets its time. With 4 KiB pages the CPU's stream prefetchers stop at every page
boundary and each page costs a TLB entry; on 2 MiB pages they run on. Measured on
a 2-core AMD EPYC (Zen 4), the Qwen3-0.6B shape's bf16 weights streamed by the bf16
row kernel: 1.12x the rate on 4 KiB pages, alternating in one process.

Most Linux systems give huge pages only where asked (`transparent_hugepage` set to
`madvise`), and torch's allocator asks only under `THP_MEM_ALLOC_ENABLE=1` read at
import. So a tensor of 2 MiB or more is placed in an anonymous mapping of its own,
2 MiB aligned and advised `MADV_HUGEPAGE` before anything touches it; its first
write (the checkpoint's copy, the packing) then faults in whole huge pages. Values
are those of `torch.empty` / the copied tensor. Elsewhere (another OS, a smaller
tensor, a refused mapping) `torch.empty` as usual: only the speed differs.
"""

from __future__ import annotations

import logging
import mmap
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 * 2**20
_refused: list[str] = []  # why the first mapping failed; nothing more is tried after
Device = torch.device | str


def available() -> bool:
    """Whether tensors may be placed on huge pages here (Linux, not refused before)."""
    return sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE") and not _refused


def _mapped(shape: tuple[int, ...], dtype: torch.dtype, device: Device) -> torch.Tensor | None:
    """A contiguous CPU tensor in a fresh mapping advised for huge pages (reading as
    zeros until written), or None off the CPU, where it is too small, or refused."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not available():
        return None
    try:
        # private and anonymous (a shared mapping is shmem, with huge pages of its own rule);
        # one page more than needed, to start on a 2 MiB boundary
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as err:  # no memory map, or advice refused: plain pages
        _refused.append(str(err))
        log.info("servelab: weights stay on 4 KiB pages (huge pages refused: %s)", err)
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)


def empty(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: Device = "cpu"
) -> torch.Tensor:
    """`torch.empty` (contiguous); on the CPU on huge pages where the tensor is large
    enough and the system allows."""
    t = _mapped(tuple(shape), dtype, device)
    return torch.empty(tuple(shape), dtype=dtype, device=device) if t is None else t


def zeros(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: Device = "cpu"
) -> torch.Tensor:
    """`torch.zeros`, placed as `empty` places it, and written through once as
    `torch.zeros` writes it: every page is taken now, not in the first step that
    writes it. A fresh mapping reads as zeros without the write, but the system
    would then fault its pages in one at a time inside the steps that first store
    K/V there (on 2 MiB pages with `defrag=madvise`, compacting memory for each:
    measured 0.86 s a GiB on first touch, 2-3 s of a 40 s bf16 workload's steps)."""
    t = _mapped(tuple(shape), dtype, device)
    return torch.zeros(tuple(shape), dtype=dtype, device=device) if t is None else t.zero_()


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t`, on huge pages where `empty` places it."""
    out = empty(t.shape, t.dtype)
    return out.copy_(t)
