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
from typing import Any

import torch
import torch.distributed as dist

from servelab.executor.cuda_graphs import DecodeGraphRunner
from servelab.executor.kv_cache import KVCache
from servelab.executor.parallel.common import (
    CONTROL_TIMEOUT,
    PARENT_POLL_SECONDS,
    data_backend,
    error_key,
    make_all_reduce,
    rank_device,
    started_key,
)
from servelab.executor.parallel.protocol import (
    BIND,
    CAPTURE,
    LOAD,
    RELEASE,
    SHUTDOWN,
    STEP,
    BindMessage,
    CaptureMessage,
    LoadMessage,
    StepMessage,
    device_metadata,
    load_shard,
    receive_message,
    shard_kv_cache,
)
from servelab.model.transformer import AllReduce, Transformer
from servelab.registry.construct import attention_backend


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
    backend: str,
) -> None:
    """A worker started by rank 0's engine (`python -m servelab.executor.parallel`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    store.set(started_key(rank), "1")
    device = rank_device(device_type, rank, backend)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(list(range(size)), backend="gloo", timeout=CONTROL_TIMEOUT)
    code = serve(rank, size, device, store, control)
    os._exit(code)  # no interpreter teardown: the group is gone, nothing is left to flush


def serve_worker(device: str = "cpu", timeout_s: float = 300.0, backend: str = "auto") -> bool:
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
    backend = data_backend(device_type, backend)
    local_device = rank_device(device_type, int(os.environ.get("LOCAL_RANK", rank)), backend)
    dist.init_process_group(
        backend,
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
    del control  # its threads are joined here, not in finalization (see protocol._held)
    return True


class ShardRuntime:
    """A worker's model shard, KV cache, backend and decode graphs; one method per message."""

    def __init__(self, rank: int, size: int, device: torch.device, all_reduce: AllReduce):
        self.rank, self.size, self.device = rank, size, device
        self.all_reduce = all_reduce
        self.model: Transformer | None = None
        self.forward: Any = None
        self.kv_cache: KVCache | None = None
        self.backend: Any = None
        self.block_size = 0
        self.graphs: DecodeGraphRunner | None = None

    def load(self, message: LoadMessage) -> None:
        self.release()
        self.model, self.forward, _, _ = load_shard(
            message, self.rank, self.size, self.device, self.all_reduce
        )

    def bind(self, message: BindMessage) -> None:
        self.kv_cache = shard_kv_cache(self.model, message, self.device)
        self.backend = attention_backend(message.attention, self.model.config)
        self.block_size = message.block_size
        self.graphs = None

    def run_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_plan: Any):
        return self.forward.forward(
            input_ids, positions, self.kv_cache.layers, self.backend, attn_plan
        )

    def capture(self, message: CaptureMessage) -> None:
        """The same buckets as rank 0's, captured in the same order as rank 0's."""
        graphs = DecodeGraphRunner(
            self.run_forward,
            self.backend,
            max_num_seqs=message.max_num_seqs,
            max_model_len=message.max_model_len,
            block_size=self.block_size,
            device=self.device,
        )
        if not graphs.enabled:  # rank 0 captures only where every rank can: never expected
            raise RuntimeError(f"cannot capture decode graphs here: {graphs.disabled_reason}")
        graphs.capture()
        self.graphs = graphs

    @torch.inference_mode()
    def step(self, message: StepMessage) -> None:
        for copies in message.copies:
            self.kv_cache.apply(copies)
        meta = device_metadata(message.meta, self.device)
        input_ids = message.input_ids.to(self.device)
        if self.graphs is not None:  # replays the bucket rank 0 replays, or runs eagerly as it does
            hidden = self.graphs.run(input_ids, meta)
        else:
            hidden = self.run_forward(input_ids, meta.positions, self.backend.plan(meta))
        if len(meta.logits_indices):  # rank 0 samples: it gathers every rank's logits chunk
            chunk = self.forward.logits(hidden[meta.logits_indices])
            dist.gather(chunk.contiguous(), dst=0)

    def release(self) -> None:
        self.model = self.forward = self.kv_cache = self.backend = self.graphs = None


def serve(rank: int, size: int, device: torch.device, store, control) -> int:
    """The message loop; the exit code (0 after `shutdown`)."""
    runtime = ShardRuntime(rank, size, device, make_all_reduce())
    handlers = {
        LOAD: runtime.load,
        BIND: runtime.bind,
        CAPTURE: runtime.capture,
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
            if kind in (LOAD, BIND, CAPTURE):
                dist.barrier()  # rank 0 learns here that the shard loaded (or that it failed)
        except BaseException as exc:  # noqa: BLE001 (a worker reports every failure, then exits)
            cause = f"{type(exc).__name__}: {exc}"
            detail = traceback.format_exc(limit=8)
            try:
                store.set(error_key(rank), f"{cause}\n{detail}")
            except Exception:  # the store lives in rank 0: it may be gone too
                pass
            return 1
