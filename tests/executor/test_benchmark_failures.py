"""The throughput benchmark never turns a failure into a figure: a failed step (or a
request ending in an error) makes its row an error, a phase that runs out of time
leaves a row naming the stage it stopped in, and step records meet their shapes
by step index even when a failed step left no record. The tiny model on the
CPU with the `padded` backend (no Triton: runs with the kernels compiled too)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from servelab import LLM, SamplingParams
from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gpu_throughput")


def tiny_args(bench, records, *extra):
    argv = ["--tiny", "--backends", "padded", "--graphs", "off", "--requests", "3"]
    return bench.parse_args([*argv, "--records", str(records), *extra])


def workload(bench, args):
    from servelab.model.config import named_config

    vocab = named_config(args.model).vocab_size
    return bench.make_workload(args.requests, args.min_len, args.max_len, vocab, args.seed)


def last_rows(records) -> list[dict]:
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    return [r for r in rows if r["kind"] == "run"]


def fail_after(calls: int):
    """An `execute` wrapper that raises from its `calls`-th call on, once."""
    state = {"n": 0}

    def wrap(execute):
        def failing(plan):
            state["n"] += 1
            if state["n"] == calls:
                raise RuntimeError("CUDA out of memory (injected)")
            return execute(plan)

        return failing

    return wrap


def build_failing_after_warm_up(bench, monkeypatch, calls: int):
    """The engine fails one step `calls` steps into the timed run."""
    warm_up = bench.warm_up

    def warm_then_arm(llm, args, vocab_size):
        warm_up(llm, args, vocab_size)
        executor = llm.engine.executor
        monkeypatch.setattr(executor, "execute", fail_after(calls)(executor.execute))

    monkeypatch.setattr(bench, "warm_up", warm_then_arm)


def test_a_failed_step_in_the_timed_run_is_an_error_row(bench, tmp_path, monkeypatch):
    records = tmp_path / "records.jsonl"
    args = tiny_args(bench, records)
    build_failing_after_warm_up(bench, monkeypatch, calls=3)
    result = bench.run_one(args, "padded", False, workload(bench, args), bandwidth=1e9,
                           phase=bench.Phase(time.monotonic(), None, str(records)))  # fmt: skip
    assert result.status.startswith("error: 1 failed steps"), result.status
    assert "RuntimeError" in result.status and "requests ended in an error" in result.status
    assert not result.has_figures and result.output_tok_s == 0
    table_row = bench.table([result]).splitlines()[-1]
    assert table_row.startswith("| padded | off | - | - | - |"), table_row
    assert last_rows(records)[-1]["status"] == result.status  # the row on disk says so too


def test_an_errored_request_in_the_warm_up_is_an_error_row(bench, tmp_path, monkeypatch):
    args = tiny_args(bench, tmp_path / "records.jsonl")
    build = bench.build_llm

    def build_failing(*a):
        llm = build(*a)
        executor = llm.engine.executor
        monkeypatch.setattr(executor, "execute", fail_after(1)(executor.execute))
        return llm

    monkeypatch.setattr(bench, "build_llm", build_failing)
    result = bench.run_one(args, "padded", False, workload(bench, args), bandwidth=1e9)
    assert result.status.startswith("error: 1 requests failed while warming up"), result.status
    assert not result.has_figures


def test_a_deadline_passed_between_stages_names_the_stage(bench, tmp_path, monkeypatch):
    records = tmp_path / "records.jsonl"
    args = tiny_args(bench, records)
    phase = bench.Phase(time.monotonic(), 1e6, str(records))
    warm_up = bench.warm_up

    def slow_warm_up(*a):
        warm_up(*a)
        phase.limit_s = -1.0  # the warm-up used up the phase

    monkeypatch.setattr(bench, "warm_up", slow_warm_up)
    result = bench.run_one(args, "padded", False, workload(bench, args), 1e9, phase)
    assert result.status.startswith("timed out while timed run"), result.status
    assert not result.has_figures
    assert bench.exit_status([result]) == 124


def test_sigterm_from_timeout_leaves_a_row_with_the_stage(bench, tmp_path, monkeypatch):
    """`timeout` sends SIGTERM at the phase limit: the row says where it stopped,
    the later runs say they never started, and the exit status is 124."""
    records = tmp_path / "records.jsonl"

    def killed_while_warming(*_):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this returns

    monkeypatch.setattr(bench, "warm_up", killed_while_warming)
    before = signal.getsignal(signal.SIGTERM)
    argv = ["--tiny", "--backends", "padded", "per_request", "--graphs", "off", "--requests", "2"]
    results = bench.main([*argv, "--phase-seconds", "600", "--records", str(records)])
    assert signal.getsignal(signal.SIGTERM) is before  # restored
    first, second = results
    assert first.status.startswith("timed out while warming up"), first.status
    assert second.status == "not started: the phase timed out"
    assert bench.exit_status(results) == 124
    on_disk = {r["backend"]: r["status"] for r in last_rows(records)}
    assert on_disk == {"padded": first.status, "per_request": second.status}


def test_a_killed_run_reads_as_stopped_in_the_check_report(tmp_path):
    """SIGKILL leaves the row at its last stage: the report names the stage and
    shows no figures, and the phase reads as killed."""
    report = load_benchmark("gpu_report")
    row = report.RunResult("padded", "off", status="running: warming up (first compiles)",
                           wall_s=3.0, output_tok_s=123.0)  # fmt: skip
    lines = [
        {"kind": "phase", "name": "bench:padded-off", "rc": "planned", "seconds": "-",
         "limit_s": "40", "log": "-"},
        {"kind": "run", **report.asdict(row)},
        {"kind": "phase", "name": "bench:padded-off", "rc": "137", "seconds": "45",
         "limit_s": "40", "log": "bench.log"},
    ]  # fmt: skip
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    markdown = report.check_report(str(tmp_path))
    assert "| bench:padded-off | killed at its limit | 45 | 40 | bench.log |" in markdown
    assert "stopped (running: warming up (first compiles)): no figures" in markdown
    assert "123" not in markdown


def test_step_records_meet_their_shapes_by_step_index(bench, monkeypatch):
    """A failed step records nothing: pairing by position would give every later
    record the shape of the step before it. By index, every decode-only shape
    belongs to a record without prefill tokens and the other way round."""
    shapes_module = sys.modules["gpu_phase"]
    llm = LLM(model="tiny", attention="padded", device="cpu", dtype="float32", seed=0,
              max_num_seqs=4, kv_cache_memory=1 << 20, num_threads=1)  # fmt: skip
    engine = llm.engine
    shapes = shapes_module.StepShapes(engine)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    monkeypatch.setattr(engine.executor, "execute", fail_after(3)(engine.executor.execute))
    engine.add_request(list(range(5, 13)), params)
    while engine.has_unfinished():  # prefill, decode, then the failing decode
        engine.step()
    engine.add_request(list(range(20, 30)), params)
    while engine.has_unfinished():  # a prefill and five decodes, all recorded
        engine.step()
    assert sum(engine.step_failures.values()) == 1
    pairs = shapes.pair(engine.metrics.steps)
    assert len(pairs) == len(engine.metrics.steps) == 2 + 6
    assert [shape.decode_only for _, shape in pairs] == [False, True, False] + [True] * 5
    assert all(shape.decode_only == (rec.prefill_tokens == 0) for rec, shape in pairs)
