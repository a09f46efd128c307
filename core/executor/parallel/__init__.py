"""Tensor parallelism on torch.distributed: rank 0 runs the engine, ranks
1..N-1 run their shard of each step's forward (`docs/parallel.md`).

`protocol` holds the messages and the shard loading every rank shares,
`common` the rest both sides share, `group` rank 0's side (starting, talking to
and stopping the workers), `worker` the workers' (`worker.serve_worker` for a
program launched by torchrun).
"""

from servelab.executor.parallel.group import current_group, shutdown_workers

__all__ = ["current_group", "shutdown_workers"]
