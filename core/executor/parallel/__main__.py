"""`python -m servelab.executor.parallel RANK SIZE HOST PORT DEVICE TIMEOUT PARENT_PID BACKEND`:
one tensor-parallel worker, as rank 0's engine starts it (`group.WorkerGroup`)."""

import sys

from servelab.executor.parallel.worker import spawned_main

if __name__ == "__main__":
    rank, size, host, port, device, timeout, parent, backend = sys.argv[1:9]
    spawned_main(
        int(rank), int(size), host, int(port), device, float(timeout), int(parent), backend
    )
