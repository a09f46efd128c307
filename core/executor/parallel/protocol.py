"""What rank 0 tells its tensor-parallel workers, and the shard every rank runs.

Messages travel as `(kind, payload)` tuples on the control group, in this order:
`load` (a model's shard), `bind` (the KV cache and the attention backend),
`capture` (the decode graphs, with `engine.cuda_graphs`), then one `step` per
engine step, `release` when the engine is replaced, `shutdown`
at the end. A step carries everything a worker's forward needs and nothing it
must decide: the block copies since the last step (run in order), the packed
token ids and the attention metadata rank 0 built; each rank plans attention
for its own heads. Rank 0's executor and every worker build their shard with
the same functions (`load_shard`, `shard_kv_cache`).
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from servelab.executor.forward import choose_forward
from servelab.executor.kv_cache import KVCache
from servelab.model.loader import load_model, resolve_dtype
from servelab.model.transformer import AllReduce, Transformer
from servelab.step.metadata import AttentionMetadata
from servelab.step.plan import BlockCopies

LOAD, BIND, CAPTURE, STEP = "load", "bind", "capture", "step"
RELEASE, SHUTDOWN = "release", "shutdown"

# A message goes in one broadcast of this many bytes (length, then the pickle),
# a larger one in a second broadcast: a collective costs milliseconds where the
# ranks share a core, so a step's message is one (torch's broadcast_object_list is two).
MESSAGE_BYTES = 64 * 1024
_LENGTH = 8

# The tensors of the last message sent or received, kept alive here. A gloo worker
# thread drops its reference to a collective's tensors a moment after the collective
# returns; were that the last reference, the thread would take the GIL to free the
# tensor's Python object, and after the last message (`shutdown`) that can fall in
# interpreter finalization, which aborts the process ("terminate called without an
# active exception"). Held here, they are freed by Python, after the groups' threads
# have been joined (`WorkerGroup.stop`, `serve_worker`).
_held: list[torch.Tensor] = []


def _hold(*tensors: torch.Tensor) -> None:
    _held[:] = tensors


def send_message(message: Any, group) -> None:
    """Rank 0: `message` to every rank of `group` (see `receive_message`)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    frame = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
    frame[:_LENGTH] = torch.frombuffer(
        bytearray(len(data).to_bytes(_LENGTH, "little")), dtype=torch.uint8
    )
    fits = len(data) <= MESSAGE_BYTES - _LENGTH
    if fits:
        frame[_LENGTH : _LENGTH + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    _hold(frame)
    dist.broadcast(frame, src=0, group=group)
    if not fits:
        rest = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        _hold(frame, rest)
        dist.broadcast(rest, src=0, group=group)


def receive_message(group) -> Any:
    """A worker: the next message rank 0 sent on `group`."""
    frame = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
    _hold(frame)
    dist.broadcast(frame, src=0, group=group)
    length = int.from_bytes(frame[:_LENGTH].numpy().tobytes(), "little")
    if length <= MESSAGE_BYTES - _LENGTH:
        return pickle.loads(frame[_LENGTH : _LENGTH + length].numpy().tobytes())
    data = torch.empty(length, dtype=torch.uint8)
    _hold(frame, data)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())


@dataclass
class LoadMessage:
    source: str  # a named shape or a checkpoint folder every rank can read
    dtype: str
    seed: int
    cpu_kernels: str
    compile: bool
    num_threads: int | None


@dataclass
class BindMessage:
    num_blocks: int
    block_size: int
    num_host_blocks: int
    attention: dict  # the backend's config node: `{"name": ..., **options}`


@dataclass
class CaptureMessage:
    max_num_seqs: int  # the decode buckets: `cuda_graphs.graph_buckets(max_num_seqs)`
    max_model_len: int


@dataclass
class StepMessage:
    copies: list[BlockCopies] = field(default_factory=list)  # since the last step, in order
    input_ids: torch.Tensor | None = None  # int64 [num_tokens], on the CPU
    meta: AttentionMetadata | None = None  # its tensors on the CPU


def host_metadata(meta: AttentionMetadata) -> AttentionMetadata:
    """`meta` with every tensor on the CPU (itself on a CPU device), to send."""
    tensors = _tensor_fields(meta)
    if all(t.device.type == "cpu" for t in tensors.values()):
        return meta
    return dataclasses.replace(meta, **{k: t.cpu() for k, t in tensors.items()})


def device_metadata(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """A received `meta` with its tensors on this rank's `device`."""
    if device.type == "cpu":
        return meta
    moved = AttentionMetadata.to_device(_tensor_fields(meta), device)
    return dataclasses.replace(meta, **moved)


def _tensor_fields(meta: AttentionMetadata) -> dict[str, torch.Tensor]:
    return {
        f.name: getattr(meta, f.name)
        for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    }


def load_shard(
    message: LoadMessage, rank: int, size: int, device: torch.device, all_reduce: AllReduce
) -> tuple[Transformer, Any, Any, Any]:
    """Rank `rank`'s shard of the model: (model, its forward, the whole model's
    config, the tokenizer or None)."""
    if message.num_threads:
        torch.set_num_threads(int(message.num_threads))
    model, config, tokenizer = load_model(
        message.source, resolve_dtype(message.dtype), device, message.seed, shard=(rank, size)
    )
    model.set_all_reduce(all_reduce)
    forward = choose_forward(model, message.cpu_kernels, bool(message.compile))
    return model, forward, config, tokenizer


def shard_kv_cache(model: Transformer, bind: BindMessage, device: torch.device) -> KVCache:
    """One rank's KV cache: its KV heads, the same block ids on every rank."""
    c = model.config
    return KVCache(
        c.num_layers,
        bind.num_blocks,
        bind.block_size,
        c.num_kv_heads,
        c.head_dim,
        model.dtype,
        device,
        num_host_blocks=bind.num_host_blocks,
    )
