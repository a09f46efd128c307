"""What rank 0 and the workers of a tensor-parallel group share: the collectives'
backend, the device of a rank, the store keys a worker reports through, the
control group's timeout and the model's all-reduce. Kept apart from `worker`
(which builds attention backends through the registry) so that rank 0's side
imports no part registry."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from servelab.errors import ConfigError

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


DISTRIBUTED_BACKENDS = ("auto", "nccl", "gloo")


def check_backend_name(requested: str, what: str = "distributed_backend") -> None:
    """A ConfigError naming the choices unless `requested` is one of them."""
    if requested not in DISTRIBUTED_BACKENDS:
        raise ConfigError(
            f"{what} must be one of {', '.join(DISTRIBUTED_BACKENDS)}, got {requested!r}"
        )


def data_backend(device_type: str, requested: str = "auto") -> str:
    """The collectives' backend (`engine.distributed_backend`): `auto` is NCCL
    between CUDA devices and gloo on CPUs; NCCL on a CPU is a ConfigError."""
    check_backend_name(requested)
    if requested == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if requested == "nccl" and device_type != "cuda":
        raise ConfigError(
            f"distributed_backend=nccl needs CUDA devices, the engine's device is "
            f"{device_type}; use gloo (or auto)"
        )
    return requested


def rank_device(device_type: str, local_rank: int, backend: str = "nccl") -> torch.device:
    """A rank's device: `cuda:local_rank`; under gloo, ranks past the machine's
    device count share devices round-robin (NCCL refuses two ranks on one)."""
    if device_type == "cuda":
        index = local_rank if backend == "nccl" else local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def make_all_reduce(group=None):
    """The model's all-reduce: the sum over every rank, in place."""

    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=group)
        return tensor

    return all_reduce
