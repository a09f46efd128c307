"""Tensor parallelism's failures: a worker that raises or is killed makes the
engine raise a `WorkerError` naming the rank and the cause, from the first
collective it breaks (bounded by the collective timeout, never a hang); normal
exit and Ctrl-C of the engine's process leave no worker behind. Each test
breaks or ends its group, so each starts one (seconds each).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from servelab import LLM, SamplingParams
from servelab.errors import WorkerError
from servelab.executor.parallel import current_group
from servelab.executor.parallel.protocol import STEP, StepMessage
from servelab.testing.oracle import cached_case
from tests.executor.tp_helpers import (  # noqa: F401
    is_running,
    no_stray_workers,
    one_group_then_none,
    run_torchrun,
    worker_children,
)

TP = dict(tensor_parallel_size=2)


@pytest.fixture(scope="module")
def cases():
    def get(arch: str):
        return cached_case(arch)

    return get


def test_a_worker_that_raises_is_named_with_its_exception(cases):
    llm = LLM(model=str(cases("qwen3").folder), dtype="float64", max_model_len=64, **TP)
    group = llm.engine.executor.group
    group.send(STEP, StepMessage())  # a step without inputs: the worker's forward raises
    with pytest.raises(WorkerError, match=r"rank 1 raised AttributeError"):
        group.barrier()
    assert current_group() is None and not worker_children()
    with pytest.raises(WorkerError, match="rank 1 raised"):  # the engine stays failed
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


def test_a_killed_worker_is_reported_and_nothing_is_left(cases):
    llm = LLM(model=str(cases("qwen3").folder), dtype="float64", max_model_len=64, **TP)
    engine = llm.engine
    (pid,) = engine.executor.group.pids
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"rank 1 was killed by signal SIGKILL"):
        for _ in range(20):
            engine.step()
    assert not is_running(pid) and not worker_children()
    # the next engine starts a fresh group
    out = LLM(model=str(cases("qwen3").folder), dtype="float64", max_model_len=64, **TP).generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=3)
    )
    assert len(out[0].outputs[0].token_ids) == 3


CHILD = """
import os, signal, sys, time
from servelab import LLM, SamplingParams
llm = LLM(model="tiny", tensor_parallel_size=2, num_threads=1)
print("pids", *llm.engine.executor.group.pids, flush=True)
if sys.argv[1] == "interrupt":
    print("running", flush=True)
    while True:  # steps until the parent's SIGINT arrives
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
"""


def press_ctrl_c(child: subprocess.Popen, presses: int = 3, wait_s: float = 60) -> tuple[str, str]:
    """SIGINT, pressed again while the child runs on, as a user would: on a loaded
    2-core machine a single press was, rarely, never acted on (twice in full suite
    runs, the child stepping on for minutes; not reproduced in 24 tries alone or
    beside two busy processes, cause not found). On a quiet machine the child
    ends within 1-2 s of the first press."""
    for _ in range(presses):
        child.send_signal(signal.SIGINT)
        try:
            return child.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    raise AssertionError(f"the child ran on through {presses} Ctrl-C presses, {wait_s:g} s apart")


@pytest.mark.parametrize("how", ["exit", "interrupt"])
def test_exit_and_ctrl_c_leave_no_worker(tmp_path, how):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    child = subprocess.Popen(
        [sys.executable, str(script), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        pids = [int(p) for p in child.stdout.readline().split()[1:]]
        assert len(pids) == 1, child.stderr.read()
        if how == "interrupt":
            assert child.stdout.readline().strip() == "running"
            out, err = press_ctrl_c(child)
        else:
            out, err = child.communicate(timeout=300)
    finally:  # a failed check must not leave the child stepping for the rest of the suite
        if child.poll() is None:
            child.kill()
            child.communicate()
    # an unhandled KeyboardInterrupt ends Python by SIGINT itself, after its atexit handlers
    assert child.returncode == (0 if how == "exit" else -signal.SIGINT), err[-3000:]
    assert not [p for p in pids if is_running(p)], "a worker outlived its engine's process"


TORCHRUN_PROGRAM = """
import os
from servelab import LLM, SamplingParams
from servelab.executor.parallel.worker import serve_worker

if serve_worker(device="cpu"):
    raise SystemExit
llm = LLM(model="tiny", tensor_parallel_size=int(os.environ["WORLD_SIZE"]), dtype="float64",
          num_threads=1)
print("tokens", *llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6))[0].outputs[0].token_ids)
"""


def test_torchrun_two_processes_give_the_single_process_tokens(tmp_path):
    """docs/parallel.md's torchrun example: rank 1 joins through `serve_worker`."""
    result = run_torchrun(tmp_path, TORCHRUN_PROGRAM, timeout=240)
    line = next(x for x in result.stdout.splitlines() if x.startswith("tokens"))
    single = LLM(model="tiny", dtype="float64", num_threads=1).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=6)
    )
    assert [int(t) for t in line.split()[1:]] == single[0].outputs[0].token_ids
