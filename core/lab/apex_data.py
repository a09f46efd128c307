"""APEX's measured NCCL collective times, as rows the collective fit reads.

APEX (github.com/microsoft/apex_plus, MIT licence) publishes collective times measured
with NCCL on A100, H100 and H200 nodes under its `profile/comm/<GPU>/`:
`all_reduce.csv`, `all_gather.csv`, `reduce_scatter.csv` (and `alltoall.csv`,
`sendrecv.csv`), columns `gpu, num_nodes, num_gpus_per_node, dtype, size(kb), time(us)`.
`size(kb)` is the buffer in KiB (APEX's simulator prices a collective of n elements at
n x the element size / 1024, so an all-reduce of T tokens of hidden size h is the row of
e T h / 1024), the whole buffer for an all-reduce, the gathered output for an
all-gather, the reduced input for a reduce-scatter; `time(us)` is the mean of many back
to back calls, in whole microseconds. Rows of `size(kb)` 0 (under 1 KiB, truncated) and
rows spanning more than one node are skipped; `dtype` picks `half` (16-bit) rows.
Nothing is downloaded: the reader takes a local copy of that folder.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from servelab.errors import ConfigError
from servelab.lab.vidur_data import MeasuredCollectives, device_folder

KIB = 1024
US = 1e-6
# the collectives the cost model prices, by APEX's file: how many passes each device
# makes over (p - 1) / p of the buffer
PASSES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
# servelab's profiles -> APEX's device folders
APEX_GPUS = {"a100-80g": "A100-SXM-80GB", "h100-sxm": "H100-SXM-80GB", "h200": "H200-SXM-141GB"}


def comm_dir(root: Path) -> Path:
    """`root` itself when it holds device folders, or its `profile/comm` (a clone)."""
    root = Path(root)
    nested = root / "profile" / "comm"
    return nested if nested.is_dir() else root


def read_collective(path: Path, collective: str, dtype: str = "half") -> MeasuredCollectives:
    sizes, devices, seconds = [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            kib, nodes = float(row["size(kb)"]), int(row["num_nodes"])
            if row["dtype"] != dtype or nodes != 1 or kib <= 0:
                continue
            sizes.append(kib * KIB)
            devices.append(float(row["num_gpus_per_node"]))
            seconds.append(float(row["time(us)"]) * US)
    return MeasuredCollectives(np.array(sizes), np.array(devices), np.array(seconds),
                               [str(path)], PASSES[collective], collective)  # fmt: skip


def read_apex(root: Path, gpu: str) -> dict[str, MeasuredCollectives]:
    """The collectives APEX measured on `gpu` (a folder under `profile/comm`), by name;
    each file that is present."""
    folder = device_folder(
        comm_dir(root), gpu, "APEX collective profiles",
        "<dir>/<GPU>/all_reduce.csv, e.g. apex_plus's profile/comm",
    )  # fmt: skip
    out = {}
    for name in PASSES:
        path = folder / f"{name}.csv"
        if path.is_file():
            measured = read_collective(path, name)
            if len(measured.seconds):
                out[name] = measured
    if "all_reduce" not in out:
        raise ConfigError(f"no single-node half-precision all_reduce.csv rows under {folder}")
    return out
