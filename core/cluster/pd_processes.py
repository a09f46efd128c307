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
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import multiprocessing
import queue
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
def serve_prefill(engine, requests: list[WorkloadRequest], device: torch.device) -> dict:
    pending = sorted(enumerate(requests), key=lambda item: (item[1].arrival_time, item[0]))
    outputs, sent, kv_bytes = {}, 0, 0
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
            kv_bytes += send_prefilled(handover, DECODE, device, clock_offset=engine.t0)
            sent += 1
    send_end(DECODE, device)
    return {"outputs": outputs, "sent": sent, "kv_bytes": kv_bytes, **_figures(engine)}


def serve_decode(engine, device: torch.device, transfer: str, hold_until: int = 0) -> dict:
    """`hold_until`: the first step waits for that many transfers (a burst arriving at a
    busy instance, reproducibly); 0 steps as soon as there is work."""
    inbox: queue.Queue = queue.Queue()

    def receive() -> None:
        while True:
            request = recv_prefilled(PREFILL, device, clock_offset=engine.t0)
            inbox.put(request)
            if request is None:
                return

    threading.Thread(target=receive, name="servelab-kv-receiver", daemon=True).start()
    outputs, received, max_waiting, ended = {}, 0, 0, False
    while not ended or engine.has_unfinished():
        holding = not ended and received < hold_until
        block = not ended and (holding or not engine.has_unfinished())
        while True:
            try:
                request = inbox.get(block=block)
            except queue.Empty:
                break
            block = False
            if request is None:
                ended = True
                break
            engine.add_prefilled_request(request, transfer)
            received += 1
        if (not ended and received < hold_until) or not engine.has_unfinished():
            continue
        for out in engine.step():
            outputs[out.request_id] = _output(out, "decode")
        max_waiting = max(max_waiting, int(engine.scheduler.stats().get("prefilled_waiting", 0)))
    return {"outputs": outputs, "received": received, "max_waiting": max_waiting,
            **_figures(engine)}  # fmt: skip


def _output(out, instance: str) -> dict:
    sample = out.outputs[0]
    return {"token_ids": sample.token_ids, "finish_reason": sample.finish_reason,
            "error": out.error, "instance": instance}  # fmt: skip


def _figures(engine) -> dict:
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
    """One process of the pair: build the engine, join the group, serve, write the JSON."""
    try:
        engine = build_engine(engine_config(_own_device(config, rank)))
        if rank == PREFILL and requests is None:  # the workload node, sized to the model
            requests = make_workload(config["workload"], engine.model_config.vocab_size,
                                     engine.max_model_len)  # fmt: skip
        device = engine.device or torch.device("cpu")
        requested = (config.get("engine") or {}).get("distributed_backend", "auto")
        backend = data_backend(device.type, requested)
        wire = device if backend == "nccl" else torch.device("cpu")
        dist.init_process_group(
            backend, init_method=f"file://{rendezvous}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=timeout),
        )  # fmt: skip
        try:
            if rank == PREFILL:
                figures = serve_prefill(engine, requests, wire)
            else:
                figures = serve_decode(engine, wire, transfer, hold_until)
            # an orderly end: neither leaves the group while the other may still read from it
            dist.barrier()
        finally:
            dist.destroy_process_group()
        Path(result).write_text(json.dumps({"backend": backend, **figures}))
    except BaseException:
        Path(result).write_text(json.dumps({"error": traceback.format_exc()}))
        raise SystemExit(1) from None


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
        _join(processes, results, timeout)
        prefill, decode = (json.loads(Path(r).read_text()) for r in results)
    outputs = {**prefill.pop("outputs"), **decode.pop("outputs")}
    return PairResult(outputs, prefill, decode)


def _join(processes: list, results: list[str], timeout: float) -> None:
    """Waits for both; a role that fails ends the other and raises with its traceback."""
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in processes):
        failed = [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for process in processes:
                if process.is_alive():
                    process.terminate()
                process.join(5)
            if not failed:
                raise ServelabError(f"the disaggregated pair did not finish in {timeout:.0f} s")
            break
        time.sleep(0.05)
    errors = []
    for rank, process in enumerate(processes):
        process.join()
        path = Path(results[rank])
        error = json.loads(path.read_text()).get("error") if path.exists() else None
        if process.exitcode != 0:
            role = "prefill" if rank == PREFILL else "decode"
            # the role that failed first says why; the other was ended
            errors.append(
                (
                    error is None,
                    f"the {role} process failed (exit code "
                    f"{process.exitcode}):\n{error or 'ended after its peer failed'}",
                )
            )
    if errors:
        raise ServelabError(sorted(errors)[0][1])
