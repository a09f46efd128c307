"""Real prefill/decode disaggregation: a prefill process and a decode process, each a
whole engine built from the same config, the prompt K/V moved between them with
torch.distributed (`servelab.cluster.kv_wire`: gloo on CPUs, NCCL between CUDA devices).

Rank 0 (prefill) admits the workload's requests at their arrival times as prefill-only
requests (`Engine.add_prefill_request`); after each step it sends every finished prefill
whose first token did not end the request, K/V included, and finishes the stream with END.
Rank 1 (decode) receives on a thread and, between its steps, admits each arrival with
`Engine.add_prefilled_request` (its scheduler, allocator and preemption decide: a transfer
that does not fit waits or recomputes, `transfer`). Each process writes its outputs,
request records and figures as JSON; `run_pair` spawns both and joins their outputs. The
tokens equal one engine's: the K/V is the prefill engine's own, decoded by the same parts.
No fixed ports: the group meets through a file (gloo then binds free ports itself). The wire
has its own process group, so the decode side's receiving thread never shares a group with
the main thread's end barrier; a failing role writes its error and exits at once (it does
not wait on a group its peer may hold), and on the deadline each role dumps its stacks.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import json
import multiprocessing
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from servelab.cluster.kv_wire import recv_prefilled, send_end, send_prefilled
from servelab.contracts.kinds import ENGINE_KINDS
from servelab.engine.build import build_engine
from servelab.errors import ConfigError, ServelabError
from servelab.executor.parallel.common import data_backend
from servelab.lab.request_builder import WorkloadRequest
from servelab.lab.workload import make_workload

PREFILL, DECODE = 0, 1
ENGINE_NODES = ("model", "engine", "hardware", *ENGINE_KINDS)


@dataclass
class PairResult:
    outputs: dict[str, dict]  # request id -> {"token_ids", "finish_reason", "instance"}
    prefill: dict[str, Any]  # each role's figures and request records
    decode: dict[str, Any]


# -- the roles (in their processes)
def serve_prefill(
    engine, requests: list[WorkloadRequest], device: torch.device, stream=None
) -> dict:
    outputs, sent, kv_bytes = {}, 0, 0
    for handover in prefilled(engine, requests, outputs):
        try:
            kv_bytes += send_prefilled(handover, DECODE, device, engine.t0, group=stream)
        except RuntimeError as error:  # gloo/NCCL: the peer left or the timeout passed
            raise ServelabError(
                f"the prefill process could not send request {handover.request_id!r} "
                f"to the decode process ({sent} sent before it): {error}"
            ) from error
        sent += 1
    send_end(DECODE, device, group=stream)
    return {"outputs": outputs, "sent": sent, "kv_bytes": kv_bytes, **role_figures(engine)}


def prefilled(engine, requests: list[WorkloadRequest], outputs: dict):
    """The prefill role's loop: admits `requests` at their arrival times as prefill-only
    requests and yields each prefilled request to hand over, as its step finishes it; a
    request its first token ended goes to `outputs` instead."""
    pending = sorted(enumerate(requests), key=lambda item: (item[1].arrival_time, item[0]))
    while pending or engine.has_unfinished():
        now = engine.now()
        while pending and pending[0][1].arrival_time <= now:
            index, req = pending.pop(0)
            engine.add_prefill_request(
                req.prompt_token_ids, req.params, req.request_id or f"req-{index}",
                priority=req.priority, client=req.client,
            )  # fmt: skip
        if not engine.has_unfinished():
            engine.sleep(max(0.0, pending[0][1].arrival_time - now))
            continue
        finished = {o.request_id: o for o in engine.step()}
        for handover in engine.take_prefilled():
            if handover.done:  # the first token ended it: this output is final
                outputs[handover.request_id] = _output(finished[handover.request_id], "prefill")
                continue
            yield handover


def serve_decode(
    engine, device: torch.device, transfer: str, hold_until: int = 0, stream=None,
    timeout: float | None = None,
) -> dict:  # fmt: skip
    """`hold_until`: the first step waits for that many transfers (a burst arriving at a
    busy instance, reproducibly); 0 steps as soon as there is work. `timeout`: the longest
    wait for the next transfer while idle. The receiving thread uses only `stream` (the
    K/V stream's process group); its failure or END reaches this thread by the inbox."""
    inbox: queue.Queue = queue.Queue()

    def receive() -> None:
        try:
            while True:
                request = recv_prefilled(PREFILL, device, clock_offset=engine.t0, group=stream)
                inbox.put(request)
                if request is None:
                    return
        except BaseException as error:  # the main thread raises it: no silent wait forever
            inbox.put(error)

    receiver = threading.Thread(target=receive, name="servelab-kv-receiver", daemon=True)
    receiver.start()
    return decode_loop(engine, inbox, transfer, hold_until, timeout, receiver.join)


def decode_loop(engine, inbox: queue.Queue, transfer: str, hold_until: int = 0,
                timeout: float | None = None, on_end=None) -> dict:  # fmt: skip
    """The decode role's loop: admits what arrives on `inbox` (a PrefilledRequest; None
    ends the stream; an exception is the sender's failure) between its steps, until the
    stream ended and every request finished. `on_end()` runs when the stream ends."""
    outputs, received, max_waiting, ended = {}, 0, 0, False
    handoff_s: list[float] = []  # per transfer: the prefill's first token to the admission here
    while not ended or engine.has_unfinished():
        holding = not ended and received < hold_until
        block = not ended and (holding or not engine.has_unfinished())
        while True:
            try:
                request = inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                if block:
                    raise ServelabError(
                        f"the decode process waited {timeout:.0f} s for transfer "
                        f"{received + 1} from the prefill process (holding for {hold_until})"
                    ) from None
                break
            block = False
            if isinstance(request, BaseException):
                raise ServelabError(
                    f"the decode process failed receiving transfer {received + 1} from "
                    f"the prefill process: {request!r}"
                ) from request
            if request is None:
                ended = True
                if on_end is not None:  # the receiver returned after END: the wire is idle
                    on_end()
                break
            if request.first_token_time is not None:  # its first token to its arrival here
                handoff_s.append(engine.now() - request.first_token_time)
            engine.add_prefilled_request(request, transfer)
            received += 1
        if (not ended and received < hold_until) or not engine.has_unfinished():
            continue
        for out in engine.step():
            outputs[out.request_id] = _output(out, "decode")
        max_waiting = max(max_waiting, int(engine.scheduler.stats().get("prefilled_waiting", 0)))
    return {"outputs": outputs, "received": received, "max_waiting": max_waiting,
            "handoff_s": handoff_s,
            **role_figures(engine)}  # fmt: skip


def _output(out, instance: str) -> dict:
    sample = out.outputs[0]
    return {"token_ids": sample.token_ids, "finish_reason": sample.finish_reason,
            "error": out.error, "instance": instance}  # fmt: skip


def role_figures(engine) -> dict:
    return {
        "t0": engine.t0,  # the engine's clock origin (perf_counter: one clock per machine)
        "records": [dataclasses.asdict(r) for r in engine.metrics.requests],
        "step_records": [s.row() for s in engine.metrics.steps],
        "preempted": sum(s.preempted for s in engine.metrics.steps),
        "steps": len(engine.metrics.steps),
        "scheduler": dict(engine.scheduler.stats()),
        "kv_blocks_held_at_end": engine.allocator.num_blocks - engine.allocator.num_free_blocks,
    }


def engine_config(config: Mapping) -> dict:
    """What one instance is built from: the engine's nodes only."""
    return {k: v for k, v in config.items() if k in ENGINE_NODES}


def _own_device(config: Mapping, rank: int) -> Mapping:
    """`engine.device=cuda` on a machine with several devices: one per process (NCCL
    refuses two ranks on one device)."""
    engine = dict(config.get("engine") or {})
    if str(engine.get("device", "cpu")) == "cuda" and torch.cuda.device_count() > 1:
        engine["device"] = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    return {**config, "engine": engine}


def role_main(rank: int, config: Mapping, requests: list, rendezvous: str, result: str,
              transfer: str, hold_until: int, timeout: float) -> None:  # fmt: skip
    """One process of the pair: build the engine, join the group, serve, write the JSON.
    SIGUSR1 dumps every thread's stack to `<result>.stacks` (the parent's deadline)."""
    stacks = open(f"{result}.stacks", "w")  # noqa: SIM115 (open for the process's life)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        engine = build_engine(engine_config(_own_device(config, rank)))
        figures = serve_role(engine, rank, config, requests, f"file://{rendezvous}", transfer,
                             hold_until, timeout)  # fmt: skip
        Path(result).write_text(json.dumps(figures))
    except BaseException:
        # no group teardown on failure: it may wait on a peer (or a thread) that never comes;
        # exiting closes the connections, so the peer's send/recv fails at once too
        error = traceback.format_exc()
        Path(result).write_text(json.dumps({"error": error}))
        print(error, file=sys.stderr, flush=True)
        os._exit(1)


def serve_role(engine, rank: int, config: Mapping, requests: list | None, init_method: str,
               transfer: str, hold_until: int, timeout: float) -> dict:  # fmt: skip
    """Joins the pair's process group at `init_method` and serves one role; its figures."""
    if rank == PREFILL and requests is None:  # the workload node, sized to the model
        requests = make_workload(config["workload"], engine.model_config.vocab_size,
                                 engine.max_model_len)  # fmt: skip
    device = engine.executor.device or torch.device("cpu")
    requested = (config.get("engine") or {}).get("distributed_backend", "auto")
    backend = data_backend(device.type, requested)
    wire = device if backend == "nccl" else torch.device("cpu")
    limit = datetime.timedelta(seconds=timeout)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=2,
                            timeout=limit)  # fmt: skip
    # the K/V stream's own group: the receiving thread never shares one with the barrier
    stream = dist.new_group([PREFILL, DECODE], timeout=limit)
    if rank == PREFILL:
        figures = serve_prefill(engine, requests, wire, stream)
    else:
        figures = serve_decode(engine, wire, transfer, hold_until, stream, timeout)
    # an orderly end: neither leaves the group while the other may still read from it
    dist.barrier()
    dist.destroy_process_group()
    return {"backend": backend, **figures}


# -- the parent
def run_pair(
    config: Mapping,
    requests: list[WorkloadRequest] | None = None,
    transfer: str = "wait",
    hold_until: int = 0,
    timeout: float = 600.0,
) -> PairResult:
    """Spawns the prefill and the decode process for `config` (one engine config, used
    by both), serves `requests` (None: the config's `workload` node) and returns every
    request's output."""
    if transfer not in ("wait", "recompute"):
        raise ConfigError(f"transfer must be one of wait, recompute, got {transfer!r}")
    if requests is None and not config.get("workload"):
        raise ConfigError("no requests and no workload node; pick one with workload=NAME")
    if any(r.after is not None for r in requests or ()):
        raise ConfigError(
            "a real disaggregated pair serves timed requests only; follow-up turns "
            "(workload.after) need the simulated cluster"
        )
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads
    with tempfile.TemporaryDirectory(prefix="servelab-pd-") as folder:
        rendezvous, results = f"{folder}/rendezvous", [f"{folder}/rank{r}.json" for r in (0, 1)]
        processes = [
            context.Process(
                target=role_main,
                args=(
                    rank,
                    dict(config),
                    requests,
                    rendezvous,
                    results[rank],
                    transfer,
                    hold_until,
                    timeout,
                ),  # fmt: skip
                name=f"servelab-{'prefill' if rank == PREFILL else 'decode'}",
            )
            for rank in (PREFILL, DECODE)
        ]
        for process in processes:
            process.start()
        _join(processes, results, timeout + 60)  # the roles' own timeouts speak first
        prefill, decode = (json.loads(Path(r).read_text()) for r in results)
    outputs = {**prefill.pop("outputs"), **decode.pop("outputs")}
    return PairResult(outputs, prefill, decode)


def _join(processes: list, results: list[str], timeout: float) -> None:
    """Waits for both; a role that fails ends the other and raises with every failed
    role's traceback, the first to fail first; past the deadline, with their stacks."""
    deadline, first = time.monotonic() + timeout, None
    while any(p.is_alive() for p in processes):
        failed = [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            first = failed[0] if failed else None
            stacks = "" if failed else _dump_stacks(processes, results)
            for process in processes:
                if process.is_alive():
                    process.terminate()
                process.join(5)
                if process.is_alive():
                    process.kill()
            if not failed:
                raise ServelabError(
                    f"the disaggregated pair did not finish in {timeout:.0f} s; "
                    f"where each process was:\n{stacks}"
                )
            break
        time.sleep(0.05)
    errors = []
    for rank, process in enumerate(processes):
        process.join()
        path = Path(results[rank])
        error = json.loads(path.read_text()).get("error") if path.exists() else None
        if process.exitcode != 0:
            role = "prefill" if rank == PREFILL else "decode"
            message = error or "ended after its peer failed"
            text = f"the {role} process failed (exit code {process.exitcode}):\n{message}"
            errors.insert(0 if rank == first else len(errors), text)
    if errors:
        raise ServelabError("\n".join(errors))


def _dump_stacks(processes: list, results: list[str]) -> str:
    """Each live role's thread stacks (faulthandler on SIGUSR1), for the deadline's error."""
    alive = [(rank, p) for rank, p in enumerate(processes) if p.is_alive()]
    if not hasattr(signal, "SIGUSR1"):
        return "(no SIGUSR1 on this platform)"
    for _, process in alive:
        os.kill(process.pid, signal.SIGUSR1)
    time.sleep(2)
    dumps = {rank: Path(f"{results[rank]}.stacks") for rank, _ in alive}
    return "\n".join(
        f"-- {'prefill' if rank == PREFILL else 'decode'} (pid {p.pid}):\n"
        + (dumps[rank].read_text() if dumps[rank].exists() else "(not started: no stacks)")
        for rank, p in alive
    )
