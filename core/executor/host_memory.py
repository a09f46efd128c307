"""Keeps a CPU engine's freed activations in the heap, so the next step reuses them.

A prefill step's activations are megabytes each. glibc serves blocks that large with `mmap`,
unmaps them when freed and trims the heap top, so every step faults the same memory in
again, page by page, inside the matmuls that first write it. `keep_freed_memory` raises
those thresholds (`SETTINGS`) once per process with `mallopt`, as `MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_` and `MALLOC_TOP_PAD_` in the environment would at start-up.

Rules: glibc only (elsewhere, e.g. musl or macOS, nothing changes and the reason is logged);
applied when an engine is built on the CPU; idempotent; those variables, when set, win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)

MiB = 1024**2
# mallopt parameters (malloc.h) and the values set
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {
    M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", 32 * MiB),  # glibc's maximum on 64-bit
    M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", 256 * MiB),
    M_TOP_PAD: ("MALLOC_TOP_PAD_", 64 * MiB),
}


@functools.cache
def keep_freed_memory() -> bool:
    """Sets glibc's thresholds (see the module doc); True when they are in effect."""
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("servelab: no glibc mallopt here; the C library's heap settings stay")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    for param, (env, value) in SETTINGS.items():
        if env in os.environ:
            continue
        if mallopt(param, value) != 1:
            log.info("servelab: mallopt(%s, %s) refused; the heap settings stay", env, value)
            return False
    return True
