"""Counts the kernels a forward launches, on any device: every torch op that
computes (views and allocations launch nothing) through a `TorchDispatchMode`,
plus every Triton kernel launch (a counting stand-in for each kernel object)."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "detach", "alias", "lift_fresh"}


class AtenCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_LAUNCH:
            self.ops[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


class CountingKernel:
    """Stands in for a Triton kernel: `kernel[grid](...)` counts, then launches."""

    def __init__(self, kernel, name: str, counts: Counter) -> None:
        self.kernel, self.name, self.counts = kernel, name, counts

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args, **kwargs):
            self.counts[f"triton.{self.name}"] += 1
            # the interpreter's own tensor copies are not the forward's launches
            with _disable_current_modes():
                return launch(*args, **kwargs)

        return counted


@contextmanager
def count_launches(monkeypatch, *modules):
    """Yields a Counter of launches by kernel name while the block runs."""
    counts: Counter = Counter()
    for module in modules:
        for name, value in vars(module).items():
            is_kernel = type(value).__name__ in ("JITFunction", "InterpretedFunction")
            if is_kernel and name.endswith("_kernel"):  # launched, not a helper it calls
                monkeypatch.setattr(module, name, CountingKernel(value, name, counts))
    mode = AtenCounter()
    with mode:
        yield counts
    counts.update(mode.ops)
