"""`python -m servelab.kernels` (what install.sh runs): it names every C++ kernel
module, and it runs them in processes of their own and reports each."""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import subprocess
import sys

import servelab.kernels
from servelab.kernels import __main__ as build_all_kernels


def test_every_cpp_kernel_module_is_built():
    """A new kernel module (one that calls `cpp_extension.build`) cannot be left out."""
    building = []
    for info in pkgutil.iter_modules(servelab.kernels.__path__, "servelab.kernels."):
        if info.name.endswith(("__main__", "cpp_extension")):
            continue
        spec = importlib.util.find_spec(info.name)
        assert spec is not None and spec.origin is not None
        with open(spec.origin) as f:
            source = f.read()
        if "cpp_extension import" in source and "build(" in source:
            building.append(info.name)
    assert sorted(building) == sorted(build_all_kernels.KERNEL_MODULES)


def test_the_command_reports_each_kernel_with_the_kernels_off():
    env = {**os.environ, "SERVELAB_CPU_KERNEL": "0"}  # no compiler run: each says so
    result = subprocess.run(
        [sys.executable, "-m", "servelab.kernels"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == list(build_all_kernels.KERNEL_MODULES)
    assert all("not built" in line for line in lines)
