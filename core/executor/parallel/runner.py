"""`TensorParallelRunner`: rank 0's model runner. It prepares and samples exactly
as `ModelRunner` does; before its own shard's forward it sends the workers the
step (the block copies since the last step, the token ids, the metadata), so
every rank runs the same layers at once and meets at the same all-reduces.
"""

from __future__ import annotations

from servelab.errors import WorkerError
from servelab.executor.model_runner import ModelRunner, StepBatch
from servelab.executor.parallel.protocol import STEP, StepMessage, host_metadata


class TensorParallelRunner(ModelRunner):
    def __init__(self, *args, group, lease: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.lease = lease  # the group's lease this engine holds; a newer engine's ends it
        self.pending_copies: list = []  # BlockCopies rank 0 ran since the last step

    def run_model(self, batch: StepBatch):
        group = self.group
        if group.lease != self.lease:
            raise WorkerError(
                "this engine's tensor-parallel workers now serve a newer engine in this "
                "process; build the engine again to use it"
            )
        message = StepMessage(
            copies=self.pending_copies,
            input_ids=batch.input_ids.cpu(),
            meta=host_metadata(batch.meta),
        )
        self.pending_copies = []
        group.in_step = True
        group.send(STEP, message)
        hidden = super().run_model(batch)
        group.in_step = False  # stays True when the forward raised: see WorkerGroup.stop
        return hidden
