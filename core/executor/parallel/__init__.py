"""Tensor parallelism on torch.distributed: rank 0 runs the engine, ranks
1..N-1 run their shard of each step's forward (`docs/parallel.md`).

`protocol` holds the messages and the shard every rank runs, `group` rank 0's
side (starting, talking to and stopping the workers), `worker` the workers'.
"""

from servelab.executor.parallel.group import current_group, shutdown_workers
from servelab.executor.parallel.worker import serve_worker

__all__ = ["current_group", "serve_worker", "shutdown_workers"]
