"""`python -m servelab.kernels`: builds every C++ CPU kernel now, side by side.

Each kernel is its own extension and its own compiler run (a few translation
units that each include torch's extension headers), so they build in parallel
processes, one per core up to one per kernel; a warm cache (see
`servelab.kernels.cpp_extension`) imports without compiling. Prints one line
per kernel and the elapsed time; exits 0 whether or not a kernel could be
built (the engine then keeps torch's ops, as the log says).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

# every module of servelab.kernels with a `kernel()` that builds a C++ extension
KERNEL_MODULES = (
    "servelab.kernels.cpu_fused",
    "servelab.kernels.cpu_linear",
    "servelab.kernels.cpu_paged",
    "servelab.kernels.cpu_decoder",
)


def build_one(module: str) -> tuple[str, bool, float]:
    """Builds (or loads) one kernel in this process: (module, built, seconds)."""
    start = time.perf_counter()
    built = importlib.import_module(module).kernel() is not None
    return module, built, time.perf_counter() - start


def build_all(workers: int | None = None) -> list[tuple[str, bool, float]]:
    """Every kernel, `workers` at a time (default: the usable cores, at most one
    per kernel), each in a process of its own."""
    if workers is None:
        workers = min(len(KERNEL_MODULES), len(os.sched_getaffinity(0)))
    if workers <= 1:
        return [build_one(m) for m in KERNEL_MODULES]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(build_one, KERNEL_MODULES))


def main() -> int:
    start = time.perf_counter()
    results = build_all()
    for module, built, seconds in results:
        state = "ready" if built else "not built (torch's ops instead; see the log above)"
        print(f"{module}: {state} ({seconds:.1f} s)")
    print(f"servelab.kernels: {time.perf_counter() - start:.1f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
