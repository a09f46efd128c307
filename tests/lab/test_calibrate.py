"""The profile fit recovers known parameters from synthetic step times, and
the calibration records real step shapes."""

from __future__ import annotations

import numpy as np
import pytest

from servelab.executor.cost_model import Shape, StepShape
from servelab.executor.hardware import load_profile
from servelab.lab.calibrate import FIT_PARAMETERS, fit_profile, predict
from servelab.model.config import named_config

SHAPE = Shape.of(named_config("bench"))
TRUE = dict(
    matmul_efficiency=0.35,
    attention_efficiency=0.08,
    bandwidth_efficiency=0.6,
    step_overhead=4e-4,
    seq_overhead=3e-5,
    matmul_half_rows=8.0,  # decodes of 1-2 rows stay memory bound, larger batches do not
)


def synthetic_steps() -> list[StepShape]:
    """Decodes of several batch sizes and contexts, long prefills, mixed steps."""
    steps = []
    for batch in (1, 2, 8, 32, 64):
        for context in (16, 256, 2048):
            steps.append(StepShape(np.zeros(0), np.zeros(0), np.full(batch, float(context)), batch))
    for q, s in [(32, 0), (128, 0), (512, 0), (1024, 0), (256, 768), (2048, 0)]:
        steps.append(StepShape(np.array([float(q)]), np.array([float(s)]), np.zeros(0), 1))
        steps.append(StepShape(np.array([float(q)]), np.array([float(s)]), np.full(8, 300.0), 9))
    return steps


def test_the_fit_recovers_known_parameters():
    truth = load_profile("cpu-local").with_fitted(**TRUE)
    steps = synthetic_steps()
    measured = predict(truth, SHAPE, steps, "float32", 4)
    start = load_profile("cpu-local")  # its own, different values
    assert any(getattr(start, k) != pytest.approx(v, rel=0.1) for k, v in TRUE.items())
    fitted = fit_profile(start, SHAPE, steps, measured, "float32", 4)
    for name in FIT_PARAMETERS:
        assert getattr(fitted, name) == pytest.approx(TRUE[name], rel=0.02), name


def test_the_fit_tolerates_noise():
    truth = load_profile("cpu-local").with_fitted(**TRUE)
    steps = synthetic_steps()
    rng = np.random.default_rng(0)
    measured = predict(truth, SHAPE, steps, "float32", 4) * rng.normal(1.0, 0.03, len(steps))
    fitted = fit_profile(load_profile("cpu-local"), SHAPE, steps, measured, "float32", 4)
    predicted = predict(fitted, SHAPE, steps, "float32", 4)
    assert np.median(np.abs(predicted / measured - 1)) < 0.04


def test_measure_records_each_steps_shape(monkeypatch):
    from servelab.lab import calibrate

    monkeypatch.setattr(calibrate, "GRID_DECODE", [(2, 16)])
    monkeypatch.setattr(calibrate, "GRID_CHUNKED", [])
    monkeypatch.setattr(calibrate, "TRAFFIC", [])
    data = calibrate.measure(model="tiny", repeats=1)
    shapes = data["shapes"]
    assert len(shapes) == len(data["seconds"]) == 8  # one prefill step, then 7 decode steps
    assert shapes[0].prefill_q.tolist() == [16, 16] and shapes[0].sampling == 2
    assert shapes[1].decode_keys.tolist() == [17, 17]
    assert shapes[-1].decode_keys.tolist() == [23, 23]
    assert all(s > 0 for s in data["seconds"])


def test_a_written_profile_loads_back(tmp_path):
    from servelab.lab.calibrate import write_profile

    fitted = load_profile("cpu-local").with_fitted(**TRUE)
    write_profile(fitted, tmp_path / "mine.yaml", "synthetic")
    loaded = load_profile(str(tmp_path / "mine.yaml"))
    assert loaded.matmul_efficiency == TRUE["matmul_efficiency"]
    assert loaded.sources["fitted"] == "synthetic"


def test_the_op_table_is_the_cost_model_vectorised():
    from servelab.lab.calibrate import OpTable

    values = {**TRUE, "matmul_half_rows": 24.0, "attention_half_rows": 7.0}
    profile = load_profile("cpu-local").with_fitted(
        **values, launch_overhead=3e-6, matmul_overhead=2e-6, attention_prefill_overhead=5e-6,
        attention_decode_overhead=7e-6, elementwise_efficiency=0.3, elementwise_full_rows=40.0,
        kernel_efficiency={"rms_norm": 0.2, "residual_add": 0.9},
    )  # fmt: skip
    steps = synthetic_steps()
    table = OpTable(SHAPE, steps, "float32", 4)
    np.testing.assert_allclose(
        table.times(profile), predict(profile, SHAPE, steps, "float32", 4), rtol=1e-12
    )
