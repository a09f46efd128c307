"""Fixtures of the kernel tests."""

from __future__ import annotations

import os
import shutil

import pytest

from servelab.kernels.cpp_extension import kernels_enabled


@pytest.fixture(autouse=True)
def needs_the_kernel(request):
    """The test module's `KERNEL` (a `servelab.kernels` module), built or loaded
    from the cache on first use, not at collection. Skipped only where it cannot
    be built (no compiler, or SERVELAB_CPU_KERNEL=0); a failed build where a
    compiler exists fails the test instead of hiding behind a skip."""
    module = getattr(request.module, "KERNEL", None)
    if module is None:
        return
    if not kernels_enabled() or shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("the C++ kernels cannot be built here (no compiler, or switched off)")
    assert module.kernel() is not None, f"{module.__name__} failed to build (see the log)"
