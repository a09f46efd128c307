"""`StepStaging`: pinned host and device buffers that move a step's metadata
to the device in one copy. On a CPU device the "device" buffer is the host
buffer itself and `upload` copies nothing."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)


class StepStaging:
    """Owns a host buffer (pinned for a CUDA device) and a device buffer of
    the same size. A step packs its metadata fields into the host buffer
    (`put`, or `host_view` to fill in place), then `upload` moves the used bytes
    with one non-blocking copy and returns typed device views.

    Rules:
    - fields are packed in `put` order, each aligned to `ALIGN` bytes, so every
      typed view is legal;
    - views returned by `upload` stay valid until the next `begin`: the next step
      reuses the buffers (on CUDA the copy and the kernels that read the views
      run in stream order, so reuse is safe for device work);
    - `begin` waits for the previous upload's copy to finish before the host
      buffer is written again (a pinned source must not change mid-copy);
    - the buffers grow (power of two) when a step needs more than they hold.
    """

    ALIGN = 16

    def __init__(self, device: torch.device | str, capacity_bytes: int = 1 << 16) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self._fields: list[tuple[str, int, int, torch.dtype]] = []  # name, offset, numel, dtype
        self._cursor = 0
        self._copy_done: torch.cuda.Event | None = None
        self.views: dict[str, torch.Tensor] = {}  # the last upload's device views, by name
        self._allocate(max(capacity_bytes, self.ALIGN))

    @property
    def capacity_bytes(self) -> int:
        return self.host.numel()

    @property
    def used_bytes(self) -> int:
        return self._cursor

    def _allocate(self, capacity: int) -> None:
        # pinned: the only host memory a copy can read while the host runs on
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.on_cuda)
        if self.on_cuda:
            self.device_buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        else:
            self.device_buffer = self.host

    def begin(self) -> None:
        """Starts a new step: forgets the fields, waits until the last copy is done."""
        if self._copy_done is not None:
            self._copy_done.synchronize()
            self._copy_done = None
        self._fields.clear()
        self.views = {}
        self._cursor = 0

    def host_view(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Reserves field `name` and returns its host tensor view to fill in place
        (`.numpy()` gives a numpy view of the same bytes)."""
        itemsize = dtype.itemsize
        offset = -(-self._cursor // self.ALIGN) * self.ALIGN
        end = offset + numel * itemsize
        if end > self.capacity_bytes:
            self._grow(end)
        self._fields.append((name, offset, numel, dtype))
        self._cursor = end
        return self.host[offset:end].view(dtype)

    def put(
        self, name: str, values: Sequence[int] | np.ndarray | torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Writes `values` (a list, numpy array or CPU tensor) as field `name`."""
        if isinstance(values, torch.Tensor):
            view = self.host_view(name, values.numel(), dtype)
            view.copy_(values.reshape(-1))
            return view
        array = np.asarray(values).reshape(-1)
        view = self.host_view(name, array.size, dtype)
        view.numpy()[:] = array
        return view

    def upload(self) -> dict[str, torch.Tensor]:
        """One copy of the used bytes to the device; returns `{name: device view}`
        (1-D; also kept as `views`, so fields put by different callers are found)."""
        used = self._cursor
        if self.on_cuda and used:
            self.device_buffer[:used].copy_(self.host[:used], non_blocking=True)
            self._copy_done = torch.cuda.Event()
            self._copy_done.record(torch.cuda.current_stream(self.device))
        self.views = {
            name: self.device_buffer[offset : offset + numel * dtype.itemsize].view(dtype)
            for name, offset, numel, dtype in self._fields
        }
        return self.views

    def _grow(self, needed: int) -> None:
        if self._copy_done is not None:  # the old host buffer may still be a copy source
            self._copy_done.synchronize()
            self._copy_done = None
        old_host, used = self.host, self._cursor
        capacity = 1 << (needed - 1).bit_length()
        log.debug("step staging grows from %d to %d bytes", old_host.numel(), capacity)
        self._allocate(capacity)
        self.host[:used].copy_(old_host[:used])  # fields already written this step
