"""Helpers of the tensor-parallel tests: the worker processes this process has,
read from /proc (not from servelab's own bookkeeping, which is what is tested),
the fixtures that check none is left behind after each test and module, and a
two-process `torchrun` of a test's program."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from servelab.executor.parallel import current_group, shutdown_workers

WORKER_MODULE = "servelab.executor.parallel"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def worker_children(parent: int | str = "self") -> set[int]:
    """Pids of the tensor-parallel workers among `parent`'s live child processes."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{parent}/task/*/children"):
        try:
            pids.update(int(p) for p in Path(path).read_text().split())
        except OSError:
            continue
    return {p for p in pids if WORKER_MODULE in _cmdline(p) and is_running(p)}


def is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, exited but not reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.fixture(scope="module", autouse=True)
def one_group_then_none():
    """The module's worker groups; at the end every worker they had is gone."""
    seen: set[int] = set()
    yield seen
    group = current_group()
    if group is not None:
        seen.update(group.pids)
    shutdown_workers()
    assert current_group() is None
    assert not worker_children(), "a worker outlived shutdown_workers()"
    assert not [pid for pid in seen if is_running(pid)]


@pytest.fixture(autouse=True)
def no_stray_workers(one_group_then_none):
    """After every test: this process's only workers are the running group's."""
    yield
    group = current_group()
    pids = set(group.pids) if group is not None else set()
    one_group_then_none.update(pids)
    assert worker_children() == pids, "a worker process was left behind"


def run_torchrun(
    folder: Path, program: str, *args: str, timeout: float
) -> subprocess.CompletedProcess:
    """`program` (dedented, written into `folder`) on two local ranks under
    `torchrun`, each on one torch thread; its exit status is asserted zero."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    script = folder / "program.py"
    script.write_text(textwrap.dedent(program))
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=2", str(script), *args],
        capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    # stdout too: whether rank 0 got as far as its output tells a failure in the run
    # from one in the processes' teardown
    assert result.returncode == 0, (
        f"exit status {result.returncode}\nstdout: {result.stdout[-1500:]}\n"
        f"stderr: {result.stderr[-4000:]}"
    )
    return result
