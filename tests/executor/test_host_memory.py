"""`servelab.executor.host_memory.keep_freed_memory`: glibc's heap thresholds, set once."""

from __future__ import annotations

import platform

import pytest

from servelab.executor import host_memory


class FakeLibc:
    """A C library whose `mallopt` records its calls (a plain function, as
    ctypes' foreign functions take `argtypes`)."""

    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []

        def mallopt(param: int, value: int) -> int:
            self.calls.append((param, value))
            return answer

        self.mallopt = mallopt


def run_with(monkeypatch, libc) -> bool:
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: libc)
    return host_memory.keep_freed_memory.__wrapped__()


def test_sets_every_threshold(monkeypatch):
    for _, (env, _) in host_memory.SETTINGS.items():
        monkeypatch.delenv(env, raising=False)
    libc = FakeLibc()
    assert run_with(monkeypatch, libc)
    assert sorted(libc.calls) == sorted(
        (param, value) for param, (_, value) in host_memory.SETTINGS.items()
    )


def test_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1")
    libc = FakeLibc()
    assert run_with(monkeypatch, libc)
    assert host_memory.M_TRIM_THRESHOLD not in [param for param, _ in libc.calls]
    assert len(libc.calls) == len(host_memory.SETTINGS) - 1


def test_a_refusal_or_no_mallopt_reports_false(monkeypatch):
    assert not run_with(monkeypatch, FakeLibc(answer=0))
    assert not run_with(monkeypatch, object())  # a C library without mallopt


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_applies_on_this_glibc():
    assert host_memory.keep_freed_memory.__wrapped__()
