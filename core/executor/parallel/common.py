"""What rank 0 and the workers of a tensor-parallel group share: the collectives'
backend, the device of a rank, the store keys a worker reports through, the
control group's timeout and the model's all-reduce. Kept apart from `worker`
(which builds attention backends through the registry) so that rank 0's side
imports no part registry."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

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
