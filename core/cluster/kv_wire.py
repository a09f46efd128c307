"""A prefilled request on the wire between two processes, with torch.distributed
point-to-point `send` / `recv` (gloo between CPU processes, NCCL between CUDA devices).

One message: a header `[kind, metadata bytes]` (int64), then the metadata as UTF-8 JSON
bytes (request id, prompt and first token, sampling parameters, the K/V's shape and dtype,
timing), then the K/V tensor `[2, num_layers, prompt tokens, num_kv_heads, head_dim]` when
there is one. `kind` END closes the stream. Times travel as the sender's engine times plus
its clock origin (`clock_offset`): on one machine `time.perf_counter` is one monotonic
clock for every process, so the receiver turns them into its own engine's times.
`group`: the process group the stream uses (the pair gives the wire its own group, so a
receiving thread never shares one with collectives of the main thread).
"""

from __future__ import annotations

import dataclasses
import json

import torch
import torch.distributed as dist

from servelab.engine.handover import PrefilledRequest
from servelab.step.sequence import SamplingParams

REQUEST, END = 0, 1
DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}


def send_prefilled(
    request: PrefilledRequest,
    dst: int,
    device: torch.device,
    clock_offset: float = 0.0,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Sends one request (blocking); returns the K/V bytes sent."""
    kv = request.kv
    meta = {
        "request_id": request.request_id,
        "prompt_token_ids": list(request.prompt_token_ids),
        "first_token": int(request.first_token),
        "params": dataclasses.asdict(request.params),
        "kv_shape": list(kv.shape) if kv is not None else None,
        "kv_dtype": str(kv.dtype) if kv is not None else None,
        "arrival_time": _shift(request.arrival_time, clock_offset),
        "first_token_time": _shift(request.first_token_time, clock_offset),
        "priority": request.priority,
        "client": request.client,
        "first_logprobs": request.first_logprobs,
    }
    payload = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    header = torch.tensor([REQUEST, payload.numel()], dtype=torch.int64, device=device)
    dist.send(header, dst, group=group)
    dist.send(payload.to(device), dst, group=group)
    if kv is None:
        return 0
    dist.send(kv.to(device).contiguous(), dst, group=group)
    return kv.numel() * kv.element_size()


def send_end(dst: int, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    dist.send(torch.tensor([END, 0], dtype=torch.int64, device=device), dst, group=group)


def recv_prefilled(
    src: int,
    device: torch.device,
    clock_offset: float = 0.0,
    group: dist.ProcessGroup | None = None,
) -> PrefilledRequest | None:
    """The next request from `src` (blocking); None at the end of the stream."""
    header = torch.zeros(2, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    kind, size = header.tolist()
    if kind == END:
        return None
    payload = torch.zeros(size, dtype=torch.uint8, device=device)
    dist.recv(payload, src, group=group)
    meta = json.loads(payload.cpu().numpy().tobytes().decode())
    kv = None
    if meta["kv_shape"] is not None:
        kv = torch.zeros(meta["kv_shape"], dtype=DTYPES[meta["kv_dtype"]], device=device)
        dist.recv(kv, src, group=group)
    return PrefilledRequest(
        request_id=meta["request_id"],
        prompt_token_ids=meta["prompt_token_ids"],
        first_token=meta["first_token"],
        params=SamplingParams(**meta["params"]),
        kv=kv,
        arrival_time=_shift(meta["arrival_time"], -clock_offset),
        first_token_time=_shift(meta["first_token_time"], -clock_offset),
        priority=meta["priority"],
        client=meta["client"],
        first_logprobs=meta["first_logprobs"],
    )


def _shift(value: float | None, offset: float) -> float | None:
    return None if value is None else value + offset
