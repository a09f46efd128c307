"""A tensor-parallel worker (ranks 1..N-1): receives rank 0's messages and runs
its shard of every step's forward until rank 0 says `shutdown` or goes away.

Two ways in: `spawned_main`, the target of the processes rank 0's engine starts
on one machine, and `serve_worker`, which a program launched by `torchrun`
calls on every rank but 0. A worker decides nothing: a message it cannot run
(an exception) is written to the group's store under `error_key(rank)`, where
rank 0 reads the cause, and the worker exits, which breaks rank 0's next
collective instead of leaving it waiting. A spawned worker also exits when its
parent does, and ignores Ctrl-C: the terminal's SIGINT reaches the whole
process group, and rank 0 alone decides how the group ends.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
import traceback

import torch
import torch.distributed as dist

from servelab.executor.parallel.protocol import (
    BIND,
    LOAD,
    RELEASE,
    SHUTDOWN,
    STEP,
    ShardRuntime,
    receive_message,
)

# Workers wait for the next step on the control group for as long as the engine
# stays idle; rank 0 going away closes the connection, which ends the wait at once.
CONTROL_TIMEOUT = datetime.timedelta(days=7)
PARENT_POLL_SECONDS = 0.5
ERROR_KEY = "servelab/tp/error/{rank}"
STARTED_KEY = "servelab/tp/started/{rank}"


def error_key(rank: int) -> str:
    return ERROR_KEY.format(rank=rank)


def started_key(rank: int) -> str:
    return STARTED_KEY.format(rank=rank)


def data_backend(device_type: str) -> str:
    """The collectives' backend: NCCL between CUDA devices, gloo on CPUs."""
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def make_all_reduce(group=None):
    """The model's all-reduce: the sum over every rank, in place."""

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=group)
        return tensor

    return all_reduce


def _watch_parent(parent_pid: int) -> None:
    """Exits this process once its parent is gone (killed without a chance to
    stop its workers): a worker never outlives its engine."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(PARENT_POLL_SECONDS)


def spawned_main(
    rank: int,
    size: int,
    host: str,
    port: int,
    device_type: str,
    timeout_s: float,
    parent_pid: int,
) -> None:
    """A worker started by rank 0's engine (`torch.multiprocessing`'s spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    store.set(started_key(rank), "1")
    device = rank_device(device_type, rank)
    dist.init_process_group(
        data_backend(device_type), store=store, rank=rank, world_size=size, timeout=timeout
    )
    control = dist.new_group(list(range(size)), backend="gloo", timeout=CONTROL_TIMEOUT)
    code = serve(rank, size, device, store, control)
    os._exit(code)  # no interpreter teardown: the group is gone, nothing is left to flush


def serve_worker(device: str = "cpu", timeout_s: float = 300.0) -> bool:
    """For a program launched by `torchrun`: on ranks 1..N-1, joins rank 0's engine,
    serves it until it shuts down, and returns True; on rank 0, returns False
    at once (rank 0 goes on to build the engine with `tensor_parallel_size=N`).

        if serve_worker():
            raise SystemExit
        llm = LLM(model=..., tensor_parallel_size=int(os.environ["WORLD_SIZE"]))
    """
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        return False
    device_type = torch.device(device).type
    local_device = rank_device(device_type, int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(
        data_backend(device_type),
        init_method="env://",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    control = dist.new_group(list(range(size)), backend="gloo", timeout=CONTROL_TIMEOUT)
    store = dist.distributed_c10d._get_default_store()
    code = serve(rank, size, local_device, store, control)
    if code:
        raise SystemExit(code)
    dist.destroy_process_group()
    return True


def serve(rank: int, size: int, device: torch.device, store, control) -> int:
    """The message loop; the exit code (0 after `shutdown`)."""
    runtime = ShardRuntime(rank, size, device, make_all_reduce())
    handlers = {
        LOAD: runtime.load,
        BIND: runtime.bind,
        STEP: runtime.step,
        RELEASE: lambda _: runtime.release(),
    }
    while True:
        try:
            kind, payload = receive_message(control)
        except Exception:  # rank 0 is gone: nobody is left to tell
            return 1
        if kind == SHUTDOWN:
            return 0
        try:
            handlers[kind](payload)
            if kind in (LOAD, BIND):
                dist.barrier()  # rank 0 learns here that the shard loaded (or that it failed)
        except BaseException as exc:  # noqa: BLE001 (a worker reports every failure, then exits)
            cause = f"{type(exc).__name__}: {exc}"
            detail = traceback.format_exc(limit=8)
            try:
                store.set(error_key(rank), f"{cause}\n{detail}")
            except Exception:  # the store lives in rank 0: it may be gone too
                pass
            return 1
