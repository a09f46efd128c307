"""Reading APEX's NCCL collective profiles (small files written here in its column format,
never the real data) and fitting a profile's collective figures to them."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from servelab.errors import ConfigError
from servelab.executor.cost_model import CostModel, Shape, collective_time
from servelab.executor.hardware import load_profile
from servelab.lab.apex_data import read_apex

HEADER = ["gpu", "num_nodes", "num_gpus_per_node", "dtype", "size(kb)", "time(us)"]
TRUTH = dict(interconnect_latency=6e-6, interconnect_latency_per_device=1.5e-6,
             interconnect_bandwidth=380e9, interconnect_half_bytes=4e7,
             interconnect_curve_exponent=0.35)  # fmt: skip
PASSES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def _write(folder: Path, name: str, rows: list[list]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        writer.writerows(rows)


def _synthetic(root: Path, truth, gpu: str = "H100-SXM-80GB") -> None:
    """Every collective at 1 KiB-128 MiB on 2, 4 and 8 GPUs, timed by `truth` through the
    cost model's scalar form (APEX writes whole microseconds; these keep the fraction so
    the fit can be held to 2%), plus rows the reader must skip."""
    folder = root / "profile" / "comm" / gpu
    for name, passes in PASSES.items():
        rows: list[list] = []
        for p in (2, 4, 8):
            rows.append([gpu, 1, p, "half", 0, 3.0])  # under 1 KiB: skipped
            for kib in (2**k for k in range(0, 18)):
                seconds = collective_time(truth, p, kib * 1024.0, passes)
                rows.append([gpu, 1, p, "half", kib, seconds * 1e6])
                rows.append([gpu, 1, p, "float", kib, 1.0])  # another dtype: skipped
            rows.append([gpu, 2, 8, "half", 1024, 1e4])  # two nodes: skipped
        _write(folder, name, rows)


def test_rows_become_bytes_devices_and_seconds(tmp_path):
    folder = tmp_path / "comm" / "H200-SXM-141GB"
    _write(folder, "all_reduce", [["H200", 1, 4, "half", 0, 9.0], ["H200", 1, 4, "half", 2, 9.0],
                                  ["H200", 1, 8, "half", 1024, 25.0], ["H200", 2, 8, "half", 4, 90.0],
                                  ["H200", 1, 8, "float", 4, 16.0]])  # fmt: skip
    _write(folder, "all_gather", [["H200", 1, 2, "half", 8, 7.0]])
    measured = read_apex(tmp_path / "comm", "H200-SXM-141GB")
    reduce = measured["all_reduce"]
    # KiB -> bytes, microseconds -> seconds; size 0, two nodes and float rows skipped
    assert reduce.bytes.tolist() == [2048.0, 1048576.0] and reduce.devices.tolist() == [4.0, 8.0]
    assert reduce.seconds.tolist() == pytest.approx([9e-6, 25e-6]) and reduce.passes == 2
    assert measured["all_gather"].passes == 1 and "reduce_scatter" not in measured


def test_a_missing_gpu_names_the_ones_there(tmp_path):
    _write(
        tmp_path / "profile" / "comm" / "H100-SXM-80GB",
        "all_gather",
        [["H100", 1, 2, "half", 8, 7.0]],
    )
    with pytest.raises(ConfigError, match="devices there: H100-SXM-80GB"):
        read_apex(tmp_path, "A100-SXM-80GB")
    with pytest.raises(ConfigError, match="no single-node half-precision all_reduce.csv"):
        read_apex(tmp_path, "H100-SXM-80GB")


def test_the_fit_recovers_known_collective_figures_and_names_its_source(tmp_path):
    from servelab.lab.calibrate import main

    truth = dataclasses.replace(load_profile("h200"), **TRUTH)
    _synthetic(tmp_path / "apex_plus", truth, "H200-SXM-141GB")
    out = tmp_path / "h200.yaml"
    main(["--profile", "h200", "--from-apex", str(tmp_path / "apex_plus"), "--apex-commit",
          "f00d", "--out", str(out)])  # fmt: skip
    fitted = load_profile(str(out))
    for name, value in TRUTH.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.02), name
    text = fitted.sources["interconnect"]
    assert "microsoft/apex_plus" in text and "f00d" in text and "MIT" in text
    assert "profile/comm/H200-SXM-141GB/all_reduce.csv: 54 rows" in text  # 3 x 18 kept
    # one-pass collectives priced by the same figures: exact on these synthetic rows
    assert "all_gather 0.0%" in text and "reduce_scatter 0.0%" in text
    # APEX's rule: an all-reduce of T tokens of hidden size h is the row of e T h bytes
    model = CostModel(Shape(8192, 1, 1, 1, 1, 1, 1), fitted, "bfloat16", 2, tp=4)
    want = collective_time(truth, 4, 2 * 64 * 8192, 2)
    assert model.all_reduce_time(64) == pytest.approx(want, rel=1e-3)
    # figures outside the collectives are the base profile's
    assert fitted.matmul_efficiency == truth.matmul_efficiency


def test_the_other_collectives_fit_nothing_and_are_reported(tmp_path):
    from servelab.lab.apex_data import read_collective
    from servelab.lab.calibrate_vidur import collective_errors

    truth = dataclasses.replace(load_profile("h100-sxm"), **TRUTH)
    _synthetic(tmp_path, truth)
    gather = read_collective(tmp_path / "profile/comm/H100-SXM-80GB/all_gather.csv", "all_gather")
    np.testing.assert_allclose(collective_errors(truth, gather), 0.0, atol=1e-9)
