"""The benchmark scripts (benchmarks/, not a package) as modules, for the tests
that call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py`, imported as module `name` (registered in `sys.modules`,
    so its dataclasses and pickling find it)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def quick_pair_home(home: Path) -> dict[str, str]:
    """Trains a seconds-long model pair (`spec_pair.py --quick`) where the presets
    look for one, `home/.cache/servelab/spec_pair/latest`, and returns the environment
    that points them there: HOME, with the CPU kernels' cache left where it is (so
    nothing is rebuilt under the new HOME)."""
    from servelab.kernels.cpp_extension import CACHE_ENV, cache_root

    spec_pair = load_benchmark("spec_pair")
    folder = home / ".cache" / "servelab" / "spec_pair" / "quick"
    with spec_pair.torch_threads(spec_pair.QUICK.threads):
        spec_pair.train(spec_pair.QUICK, 0, folder)
    spec_pair.link_latest(folder)
    return {"HOME": str(home), CACHE_ENV: str(cache_root())}
