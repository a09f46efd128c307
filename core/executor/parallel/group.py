"""`WorkerGroup`: rank 0's side of a tensor-parallel group: starting the workers,
sending them messages, the all-reduce, and turning any failure into a
`WorkerError` that names the rank and the cause.

One group per process (torch.distributed has one default process group), kept
between engines: `acquire` hands the running group to the next engine of the
same size and device, which tells the workers to load its model; a group of
another shape is stopped first. Starting one costs seconds (each worker
imports torch), loading a small model milliseconds, so successive engines
(a sweep, a test module) pay the start once. Every collective has a timeout;
a worker that dies or raises is reported from the first collective it breaks.
The group is stopped by `shutdown_workers` (also at interpreter exit): no
worker outlives the process, whether it ends normally, by an exception or Ctrl-C.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from servelab.errors import ConfigError, WorkerError
from servelab.executor.parallel import common
from servelab.executor.parallel.protocol import RELEASE, SHUTDOWN, send_message

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 5.0  # a worker asked to shut down has this long before SIGTERM, then SIGKILL
DIAGNOSE_SECONDS = 5.0  # after a broken collective: how long to wait for a dying worker's exit code


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


class WorkerGroup:
    """Ranks 1..size-1, spawned here or joined from `torchrun`, and the groups
    rank 0 talks to them on: the default group (the all-reduces, with the
    engine's timeout) and a gloo control group (the messages)."""

    def __init__(
        self, size: int, device: torch.device, timeout_s: float, backend: str = "auto"
    ) -> None:
        self.size = size
        self.device_type = device.type
        self.timeout_s = timeout_s
        self.backend = common.data_backend(device.type, backend)
        self.processes: list[subprocess.Popen] = []  # spawned workers, rank i + 1 at index i
        self.lease = 0  # which engine uses the group now (acquire increments it)
        self.broken: str | None = None  # why the group stopped working
        # True from a step's message until rank 0's forward returns: a step cut short
        # (Ctrl-C) leaves the workers inside a collective, deaf to a shutdown message
        self.in_step = False
        timeout = datetime.timedelta(seconds=timeout_s)
        if dist.is_initialized():
            raise ConfigError(
                "torch.distributed is already initialised in this process; servelab's "
                "tensor parallelism starts its own process group"
            )
        if launched_by_torchrun():
            self._join_torchrun(timeout)
        else:
            self._spawn(timeout)
        self.control = dist.new_group(
            list(range(size)), backend="gloo", timeout=common.CONTROL_TIMEOUT
        )

    # -- starting
    def _join_torchrun(self, timeout: datetime.timedelta) -> None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if rank != 0 or world != self.size:
            raise ConfigError(
                f"under torchrun the engine runs on rank 0 with tensor_parallel_size equal to "
                f"WORLD_SIZE; this is rank {rank} of {world}, asking for {self.size} "
                "(the other ranks call servelab.executor.parallel.serve_worker())"
            )
        dist.init_process_group(
            self.backend, init_method="env://", rank=0, world_size=world, timeout=timeout
        )
        self.store = dist.distributed_c10d._get_default_store()

    def _spawn(self, timeout: datetime.timedelta) -> None:
        if self.backend == "nccl" and torch.cuda.device_count() < self.size:
            raise ConfigError(
                f"tensor_parallel_size={self.size} over NCCL needs {self.size} CUDA devices "
                f"on this machine, found {torch.cuda.device_count()} (distributed_backend=gloo "
                "runs several ranks on one device, to check the code path)"
            )
        host = "127.0.0.1"
        # port 0: the OS picks a free port, so parallel test runs never collide
        self.store = dist.TCPStore(
            host, 0, self.size, is_master=True, wait_for_workers=False, timeout=timeout
        )
        for rank in range(1, self.size):
            # a fresh interpreter running the worker module, not multiprocessing's spawn:
            # that re-runs the user's __main__, which then needs an `if __name__` guard
            command = [
                sys.executable, "-m", "servelab.executor.parallel",
                str(rank), str(self.size), host, str(self.store.port), self.device_type,
                repr(self.timeout_s), str(os.getpid()), self.backend,
            ]  # fmt: skip
            self.processes.append(subprocess.Popen(command))
        self._wait_started()
        dist.init_process_group(
            self.backend, store=self.store, rank=0, world_size=self.size, timeout=timeout
        )

    def _wait_started(self) -> None:
        """Waits until every worker is up, so one that fails to start (an import
        error) is reported at once instead of after the rendezvous timeout."""
        deadline = time.monotonic() + self.timeout_s
        pending = set(range(1, self.size))
        while pending:
            for rank in sorted(pending):
                if self.store.check([common.started_key(rank)]):
                    pending.discard(rank)
                elif self.processes[rank - 1].poll() is not None:
                    raise self._fail(f"worker rank {rank} did not start: {self._cause(rank)}")
            if pending and time.monotonic() > deadline:
                raise self._fail(
                    f"tensor-parallel workers {sorted(pending)} did not start within "
                    f"{self.timeout_s:g} s"
                )
            time.sleep(0.01)

    # -- talking
    @property
    def pids(self) -> list[int]:
        """The spawned workers' process ids (none under torchrun)."""
        return [p.pid for p in self.processes]

    def check(self) -> None:
        """A WorkerError if the group is broken or a spawned worker has died."""
        if self.broken is not None:
            raise WorkerError(self.broken)
        for process in self.processes:
            if process.poll() is not None:
                raise self._fail(None)

    def send(self, kind: str, payload: Any = None) -> None:
        """One message to every worker, on the control group."""
        self.check()
        try:
            send_message((kind, payload), self.control)
        except Exception as exc:  # noqa: BLE001 (any collective failure names the worker)
            raise self._fail(exc) from exc

    def barrier(self) -> None:
        """Waits until every worker ran the last message (load, bind)."""
        try:
            dist.barrier()
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc) from exc

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (equal shapes), joined along the last dimension in
        rank order, on rank 0 (a worker sends its part with `dist.gather`)."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        try:
            dist.gather(tensor.contiguous(), parts, dst=0)
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc) from exc
        return torch.cat(parts, dim=-1)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over the ranks, in place (the model's row-parallel outputs)."""
        try:
            dist.all_reduce(tensor)
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc) from exc
        return tensor

    # -- failing
    def _cause(self, rank: int) -> str | None:
        """What happened to worker `rank`: its reported exception, its exit, or None."""
        try:
            if self.store.check([common.error_key(rank)]):
                return "raised " + self.store.get(common.error_key(rank)).decode()
        except Exception:  # noqa: BLE001 (a store that is gone says nothing)
            pass
        if rank - 1 < len(self.processes):
            code = self.processes[rank - 1].poll()
            if code is not None and code < 0:
                return f"was killed by signal {signal.Signals(-code).name}"
            if code is not None:
                return f"exited with code {code}"
        return None

    def _fail(self, exc: Exception | str | None) -> WorkerError:
        """Stops the group and returns the error that names the failed ranks and why."""
        deadline = time.monotonic() + DIAGNOSE_SECONDS
        causes: dict[int, str] = {}
        while True:  # a worker that broke the connection may not have exited yet
            causes = {r: c for r in range(1, self.size) if (c := self._cause(r)) is not None}
            if causes or not self.processes or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if causes:
            message = "; ".join(f"tensor-parallel worker rank {r} {c}" for r, c in causes.items())
        elif isinstance(exc, str):
            message = exc
        else:
            message = f"lost contact with the tensor-parallel workers ({exc})"
        self.broken = f"{message.rstrip()}\n(the engine's tensor-parallel group was stopped)"
        self.stop(graceful=False)
        return WorkerError(self.broken)

    # -- stopping
    def release(self) -> None:
        """The engine using the group is done: the workers drop its model."""
        if self.broken is None:
            try:
                self.send(RELEASE)
            except WorkerError:
                pass

    def stop(self, graceful: bool = True) -> None:
        """Ends every worker and the process groups: spawned workers by SIGTERM
        (SIGKILL after a grace period), torchrun's by a `shutdown` message when
        `graceful` and no step was cut short."""
        # spawned workers hold nothing to flush: SIGTERM, never a message that a worker
        # stuck in a collective would not read; torchrun's workers are asked to return
        graceful = graceful and not self.processes
        if graceful and self.broken is None and not self.in_step:
            try:
                send_message((SHUTDOWN, None), self.control)
            except Exception:  # noqa: BLE001 (stopping anyway)
                graceful = False
        for process in self.processes:
            _wait(process, STOP_GRACE_SECONDS if graceful else 0.0)
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                _wait(process, STOP_GRACE_SECONDS)
            if process.poll() is None:
                process.kill()
                process.wait()
        if self.broken is None:
            self.broken = "the engine's tensor-parallel group was shut down"
        if dist.is_initialized():
            dist.destroy_process_group()
        # the control group's threads end with its last reference: now, while the
        # interpreter is whole, not in its finalization (see protocol._held)
        self.control = None
        global _current
        if _current is self:
            _current = None


def _wait(process: subprocess.Popen, seconds: float) -> None:
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        pass


_current: WorkerGroup | None = None


def acquire(
    size: int, device: torch.device, timeout_s: float, backend: str = "auto"
) -> WorkerGroup:
    """The process's worker group for `size` ranks on `device`'s type over
    `backend`, started if needed; the engine that held it before loses it (its
    next step raises)."""
    global _current
    group = _current
    wanted = (size, device.type, timeout_s, common.data_backend(device.type, backend))
    if group is not None and (
        group.broken is not None
        or any(p.poll() is not None for p in group.processes)
        or (group.size, group.device_type, group.timeout_s, group.backend) != wanted
    ):
        group.stop()
        group = None
    if group is None:
        group = _current = WorkerGroup(size, device, timeout_s, backend)
    group.lease += 1
    return group


def current_group() -> WorkerGroup | None:
    """The running worker group, if any."""
    return _current


def shutdown_workers() -> None:
    """Stops the running worker group (if any): its workers exit, nothing is left behind."""
    if _current is not None:
        _current.stop()


atexit.register(shutdown_workers)
