"""Fixtures of the benchmark suite. Run it with `pytest benchmarks/` (it is not
part of the default test command; see benchmarks/README.md)."""

from __future__ import annotations

import pytest
import torch
from reference_workload import NUM_THREADS, SMOKE, reference_preset


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device")


@pytest.fixture(autouse=True, scope="session")
def reference_threads():
    """Every group runs with the reference machine's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def reference_workload() -> dict:
    """The reference workload node (see reference_workload.py)."""
    return reference_preset()["workload"]


@pytest.fixture(scope="session")
def smoke() -> bool:
    """True when the suite only checks that it runs (SERVELAB_BENCH_SMOKE=1)."""
    return SMOKE
