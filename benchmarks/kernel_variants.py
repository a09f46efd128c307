"""Which Triton kernel variants a run launches, to check a warm-up compiles them all.

Triton compiles one variant per distinct launch signature: the constexpr values, the
launch options, and for other arguments their type plus the value classes it
specialises on (an int equal to 1 or divisible by 16, a pointer 16-byte aligned),
except the arguments named in `do_not_specialize`. `VariantRecorder` wraps every
kernel of the given modules and collects these keys; it works compiled and under
the interpreter (which compiles nothing, so the keys are the only evidence there).
`compiled_variants` counts what the compiled kernels hold in their caches, free to
read after a run. Both are Python-side only: the recorder costs a few microseconds
a launch, so a timed run records only when asked.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

KERNEL_MODULES = ("servelab.plugins.attention.triton_kernels", "servelab.kernels.triton_fused")


def kernels(modules=KERNEL_MODULES) -> dict[str, object]:
    """name -> Triton kernel (a JITFunction or its interpreted twin) of each module."""
    found = {}
    for name in modules:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            fn = getattr(value, "fn", None)
            # the module's own kernels (not triton.language's helpers it imported)
            if hasattr(value, "run") and getattr(fn, "__module__", None) == name:
                found[f"{name.rsplit('.', 1)[-1]}.{attr}"] = value
    return found


def _value_class(value, specialise: bool):
    if isinstance(value, torch.Tensor):
        return ("ptr", str(value.dtype), value.data_ptr() % 16 == 0 if specialise else None)
    if isinstance(value, bool):
        return ("i1",)
    if isinstance(value, int):
        width = "i32" if -(2**31) <= value < 2**31 else "i64"
        if not specialise:
            return (width,)
        return (width, 1 if value == 1 else (16 if value % 16 == 0 else 0))
    if isinstance(value, float):
        return ("fp32",)
    return (type(value).__name__,)


class VariantRecorder:
    """Context manager: while active, every launch of the modules' kernels adds its
    variant key to `keys` (`take()` returns them and starts a new set)."""

    def __init__(self, modules=KERNEL_MODULES) -> None:
        self.kernels = kernels(modules)
        self.keys: set[tuple] = set()

    def take(self) -> set[tuple]:
        keys, self.keys = self.keys, set()
        return keys

    def __enter__(self) -> VariantRecorder:
        for name, kernel in self.kernels.items():
            kernel.run = functools.partial(self._run, name, kernel, type(kernel).run)
        return self

    def __exit__(self, *exc) -> None:
        for kernel in self.kernels.values():
            vars(kernel).pop("run", None)

    def _run(self, name, kernel, run, *args, grid, warmup, **kwargs):
        self.keys.add(variant_key(name, kernel, args, kwargs))
        return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)


@functools.cache
def _signature(kernel) -> tuple[tuple[str, ...], frozenset[str], frozenset[str]]:
    """(argument names, constexpr names, names not specialised) of a kernel."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    names = tuple(p.name for p in params)
    constexpr = frozenset(p.name for p in params if "constexpr" in str(p.annotation))
    skip = getattr(kernel, "do_not_specialize", None)
    if skip is None:  # the interpreter keeps the decorator's arguments
        skip = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    skip = frozenset(names[s] if isinstance(s, int) else s for s in skip)
    return names, constexpr, skip


def variant_key(name: str, kernel, args, kwargs) -> tuple:
    """The launch's variant: what Triton would compile a new kernel for."""
    names, constexpr, skip = _signature(kernel)
    bound = dict(zip(names, args, strict=False))
    options = []
    for key, value in kwargs.items():
        if key in names:
            bound[key] = value
        else:
            options.append((key, repr(value)))  # num_warps, num_stages
    classes = tuple(
        (arg, repr(bound[arg]) if arg in constexpr else _value_class(bound[arg], arg not in skip))
        for arg in names
        if arg in bound
    )
    return (name, classes, tuple(sorted(options)))


def compiled_variants(modules=KERNEL_MODULES) -> int | None:
    """Variants the compiled kernels hold, all devices; None where none is compiled
    (the interpreter) or this Triton keeps its cache elsewhere."""
    total, seen = 0, False
    for kernel in kernels(modules).values():
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            continue
        seen = True
        try:
            total += sum(len(entry[0]) for entry in caches.values())
        except (TypeError, IndexError, KeyError):
            return None
    return total if seen else None
