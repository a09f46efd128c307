"""Prefill/decode disaggregation on Ray: the prefill and the decode engine are Ray actors
(`cluster.backend=ray`), placed by the cluster's resources, and a prefilled request's K/V
crosses between them one of two ways (`cluster.kv_transport`):

- `object_store`: the prefill actor yields each prefilled request (its K/V a tensor) from a
  Ray streaming generator; the driver passes each result's ObjectRef, unread, to the decode
  actor, so Ray moves the K/V from the prefill actor's node to the decode actor's (its
  object store, or inline for small objects), never through the driver;
- `torch`: the two actors form a torch.distributed group (gloo on CPUs, NCCL on GPUs; the
  prefill actor's node and a free port are the rendezvous) and use the same K/V wire as
  the two-process pair (servelab.cluster.kv_wire).

Either way the roles run the same loops as the process pair (servelab.lab.cluster.
pd_processes: `prefilled`, `decode_loop`, `serve_role`), so the tokens equal one engine's,
and the result is the same `PairResult`. Request times cross as the sender's engine times
plus its clock origin: exact between actors on one machine (one monotonic clock), skewed by
the machines' clock difference across machines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import socket
import time
from collections.abc import Mapping
from typing import Any

from servelab.cluster.options import KV_TRANSPORTS
from servelab.engine.build import build_engine
from servelab.errors import ConfigError
from servelab.lab.cluster.pd_processes import (
    DECODE,
    PREFILL,
    PairResult,
    decode_loop,
    engine_config,
    prefilled,
    role_figures,
    serve_role,
)
from servelab.lab.request_builder import WorkloadRequest
from servelab.lab.workload import make_workload


def _shifted(request, offset: float):
    """The request with its times moved by `offset` (sender's engine -> absolute -> receiver's)."""
    return dataclasses.replace(
        request,
        arrival_time=None if request.arrival_time is None else request.arrival_time + offset,
        first_token_time=(None if request.first_token_time is None
                          else request.first_token_time + offset),  # fmt: skip
    )


class PrefillRole:
    def __init__(self, config: Mapping) -> None:
        self.config = config
        self.engine = build_engine(engine_config(config))
        self.result: dict[str, Any] = {}

    def rendezvous(self) -> str:
        """`tcp://` address on this actor's node for the pair's process group."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://{host}:{port}"

    def serve_torch(self, requests, init_method: str, timeout: float) -> dict:
        return serve_role(self.engine, PREFILL, self.config, requests, init_method, "wait", 0,
                          timeout)  # fmt: skip

    def stream(self, requests):
        """Yields each prefilled request (times absolute); the figures go to `figures()`."""
        if requests is None:
            requests = make_workload(self.config["workload"], self.engine.model_config.vocab_size,
                                     self.engine.max_model_len)  # fmt: skip
        outputs: dict = {}
        sent, kv_bytes = 0, 0
        for handover in prefilled(self.engine, requests, outputs):
            kv = handover.kv
            kv_bytes += 0 if kv is None else kv.numel() * kv.element_size()
            sent += 1
            yield _shifted(dataclasses.replace(handover, kv=None if kv is None else kv.cpu()),
                           self.engine.t0)  # fmt: skip
        self.result = {"backend": "ray-object-store", "outputs": outputs, "sent": sent,
                       "kv_bytes": kv_bytes, **role_figures(self.engine)}  # fmt: skip

    def figures(self) -> dict:
        return self.result


class DecodeRole:
    """An async actor: `admit` calls fill the inbox (in any order: each waits for its
    handover's object) while `serve` runs the decode loop on a thread."""

    def __init__(self, config: Mapping, transfer: str) -> None:
        self.config, self.transfer = config, transfer
        self.engine = build_engine(engine_config(config))
        self.inbox: queue.Queue = queue.Queue()

    async def admit(self, request) -> None:
        if request is not None:
            device = self.engine.executor.device
            if request.kv is not None and device is not None:
                request = dataclasses.replace(request, kv=request.kv.to(device))
            request = _shifted(request, -self.engine.t0)
        self.inbox.put(request)

    async def fail(self, message: str) -> None:
        self.inbox.put(RuntimeError(message))

    async def serve(self, hold_until: int, timeout: float) -> dict:
        figures = await asyncio.to_thread(decode_loop, self.engine, self.inbox, self.transfer,
                                          hold_until, timeout)  # fmt: skip
        return {"backend": "ray-object-store", **figures}

    async def serve_torch(self, init_method: str, hold_until: int, timeout: float) -> dict:
        return await asyncio.to_thread(serve_role, self.engine, DECODE, self.config, None,
                                       init_method, self.transfer, hold_until, timeout)  # fmt: skip


def run_pair_ray(
    config: Mapping,
    requests: list[WorkloadRequest] | None = None,
    transfer: str = "wait",
    kv_transport: str = "object_store",
    hold_until: int = 0,
    timeout: float = 600.0,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
) -> PairResult:
    """Serves `requests` (None: the config's workload) on a prefill and a decode actor of
    the connected Ray cluster (servelab.cluster.ray_replicas.connect)."""
    import ray

    if kv_transport not in KV_TRANSPORTS:
        raise ConfigError(
            f"cluster.kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {kv_transport!r}"
        )
    if requests is None and not config.get("workload"):
        raise ConfigError("no requests and no workload node; pick one with workload=NAME")
    resources = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    prefill = ray.remote(PrefillRole).options(**resources).remote(dict(config))
    decode = ray.remote(DecodeRole).options(**resources).remote(dict(config), transfer)
    started = time.perf_counter()
    try:
        if kv_transport == "torch":
            init = ray.get(prefill.rendezvous.remote(), timeout=timeout)
            rank0 = prefill.serve_torch.remote(requests, init, timeout)
            rank1 = decode.serve_torch.remote(init, hold_until, timeout)
            first, second = ray.get([rank0, rank1], timeout=timeout + 60)
        else:
            done = decode.serve.remote(hold_until, timeout)
            admitted = []
            try:
                for ref in prefill.stream.remote(requests):
                    # Ray hands the K/V to the decode actor itself
                    admitted.append(decode.admit.remote(ref))
                # an async actor may run its calls out of order (a call waits for its
                # argument's object): the end mark goes once every handover is in the inbox
                ray.get(admitted, timeout=timeout)
            except ray.exceptions.RayError as error:
                decode.fail.remote(f"the prefill actor failed: {error}")
                raise
            decode.admit.remote(None)
            second = ray.get(done, timeout=timeout + 60)
            first = ray.get(prefill.figures.remote())
    finally:
        for actor in (prefill, decode):
            ray.kill(actor, no_restart=True)
    first["wall_s"] = second["wall_s"] = time.perf_counter() - started
    outputs = {**first.pop("outputs"), **second.pop("outputs")}
    return PairResult(outputs, first, second)
