"""Fewer cyclic garbage-collector passes while a simulated run serves (`fewer_gc_passes`).

A simulated run allocates millions of short-lived objects, which reference counting frees,
and keeps what it records: every step's and every request's record, every token list. At
the interpreter's default thresholds (700, 10, 10) the collector's full passes walk all of
that again and again: about a tenth of the CPU of a 64-replica cluster run or of the
10,000-request 70B run. While a run on a virtual clock serves, the first threshold is
10,000 allocations instead (every pass a tenth as often). What is simulated does not
change; cyclic garbage (a finished request's group and its sequences) is still collected;
the thresholds are restored after. A run on a real clock keeps the interpreter's: its
timings are the measurement.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

FIRST_THRESHOLD = 10_000  # allocations between young collections while a simulation serves


@contextmanager
def fewer_gc_passes() -> Iterator[None]:
    thresholds = gc.get_threshold()
    if thresholds[0]:  # 0: automatic collection is off, and stays off
        gc.set_threshold(max(thresholds[0], FIRST_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
