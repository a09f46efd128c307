"""`TensorParallelRunner`: rank 0's model runner. It prepares and samples exactly
as `ModelRunner` does; before its own shard's forward it sends the workers the
step (the block copies since the last step, the token ids, the metadata), so
every rank runs the same layers at once and meets at the same all-reduces.
"""

from __future__ import annotations

import torch

from servelab.errors import WorkerError
from servelab.executor.cuda_graphs import DecodeGraphRunner
from servelab.executor.model_runner import ModelRunner, StepBatch
from servelab.executor.parallel.protocol import (
    CAPTURE,
    STEP,
    CaptureMessage,
    StepMessage,
    host_metadata,
)


class TensorParallelRunner(ModelRunner):
    def __init__(self, *args, group, lease: int, vocab_size: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.vocab_size = vocab_size  # the whole vocabulary: the gathered chunks' padding cut off
        self.lease = lease  # the group's lease this engine holds; a newer engine's ends it
        self.pending_copies: list = []  # BlockCopies rank 0 ran since the last step

    def check_lease(self) -> None:
        if self.group.lease != self.lease:
            raise WorkerError(
                "this engine's tensor-parallel workers now serve a newer engine in this "
                "process; build the engine again to use it"
            )

    def capture_graphs(
        self, graphs: DecodeGraphRunner, max_num_seqs: int, max_model_len: int
    ) -> None:
        """Every rank captures the same buckets in the same order, at once: the
        warm-up forwards meet at their all-reduces, as the replays will."""
        self.check_lease()
        self.group.send(CAPTURE, CaptureMessage(max_num_seqs, max_model_len))
        self.group.in_step = True  # the workers sit in collectives until the capture ends
        graphs.capture()
        self.group.in_step = False
        self.group.barrier()  # every worker captured (or the error names the one that failed)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Rank 0's chunk of the logits, and every worker's, gathered in rank
        order: each worker runs its LM head on the same rows (the metadata's
        `logits_indices`) right after its forward."""
        return self.group.gather_columns(super().logits(rows))[:, : self.vocab_size]

    def run_model(self, batch: StepBatch):
        self.check_lease()
        group = self.group
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
