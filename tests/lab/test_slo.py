"""SLO attainment, goodput and capacity from hand-made request rows."""

from __future__ import annotations

import json

import pytest

from servelab.errors import ConfigError
from servelab.lab.runs import Configuration, Run
from servelab.lab.slo import add_slo_figures, capacity, meets, slo_options


def row(ttft, token_times, reason="length"):
    tpot = (
        (token_times[-1] - token_times[0]) / (len(token_times) - 1)
        if len(token_times) > 1
        else None
    )
    return {
        "finish_reason": reason,
        "ttft": ttft,
        "tpot": tpot,
        "token_times": json.dumps(token_times),
    }


SLO = {"ttft_ms": 100.0, "tpot_ms": 20.0, "percentile": 90.0}


@pytest.mark.parametrize(
    "request_row, expected",
    [
        (row(0.05, [0.05, 0.06, 0.07]), True),
        (row(0.15, [0.15, 0.16]), False),  # first token too late
        (row(0.05, [0.05, 0.10, 0.15]), False),  # 50 ms per token
        (row(0.10, [0.10]), True),  # one token: no time per token to miss
        (row(0.05, [0.05, 0.06], reason="abort"), False),  # an unfinished request misses
    ],
)
def test_a_request_meets_every_target_or_misses(request_row, expected):
    assert meets(request_row, SLO) is expected


def test_inter_token_target_checks_every_gap():
    smooth, stalled = row(0.01, [0.01, 0.02, 0.03]), row(0.01, [0.01, 0.02, 0.09])
    assert meets(smooth, {"itl_ms": 30.0}) and not meets(stalled, {"itl_ms": 30.0})


class FakeRun(Run):
    def __init__(self, rows, wall, swept):
        super().__init__(folder=None, results={"summary": {"wall_time_s": wall}}, params=swept)
        self.rows, self.swept = rows, swept

    def requests(self):
        return self.rows


def test_attainment_goodput_and_capacity():
    good, bad = row(0.05, [0.05, 0.06]), row(0.5, [0.5, 0.6])
    configs = []
    for rate, rows in ((1, [good] * 10), (2, [good] * 9 + [bad]), (4, [good] * 5 + [bad] * 5)):
        run = FakeRun(rows, wall=2.0, swept={"workload.rate": str(rate), "scheduler": "x"})
        add_slo_figures([run], SLO)
        configs.append(Configuration(dict(run.swept), [run]))
    attained = [c.runs[0].summary["slo_attainment_pct"] for c in configs]
    assert attained == [100.0, 90.0, 50.0]
    assert [c.runs[0].summary["goodput_rps"] for c in configs] == [5.0, 4.5, 2.5]
    (found,) = capacity(configs, SLO)
    assert found["configuration"] == "scheduler=x" and found["capacity_rps"] == 2.0
    assert found["attainment_by_rate"] == {1.0: 100.0, 2.0: 90.0, 4.0: 50.0}


@pytest.mark.parametrize(
    "node, message",
    [
        ({"ttft_ms": "fast"}, "report.slo.ttft_ms must be a finite number"),
        ({"ttft_ms": -1}, "report.slo.ttft_ms must be > 0"),
        ({"ttft_ms": 100, "percentile": 120}, "at most 100"),
        ({"percentile": 90}, "needs at least one target"),
        ({"ttft": 100}, "unknown report.slo key 'ttft'; accepted: ttft_ms"),
        ([100], "must be a mapping"),
    ],
)
def test_bad_slos_are_config_errors(node, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        slo_options(node)
