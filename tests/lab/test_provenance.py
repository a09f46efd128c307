"""Every results.json says what produced it, and a report over runs from
different versions or machines warns."""

from __future__ import annotations

import json
import platform

import torch

from servelab.lab.provenance import (
    config_hash,
    cpu_snapshot,
    machine_load,
    mixed_provenance,
    provenance,
)
from servelab.lab.report import write_report
from servelab.lab.runner import model_name, run_config, save_run

TINY_RUN = {
    "model": {"name": "tiny"},
    "engine": {"kv_cache_memory": "4MiB", "max_model_len": 128},
    "workload": {"name": "synthetic", "num_requests": 2, "prompt_len": 8, "output_len": 3},
    "run": {"progress": False, "warmup": False},
}


def test_results_json_records_code_libraries_machine_config_and_command(tmp_path):
    result = run_config(TINY_RUN)
    save_run(tmp_path, result, TINY_RUN, {"overrides": [], "choices": {"model": "tiny"}})
    found = json.loads((tmp_path / "results.json").read_text())["provenance"]
    assert found["torch"] == torch.__version__.split("+")[0] or found["torch"] == torch.__version__
    assert found["python"] == platform.python_version()
    assert found["servelab"] and found["transformers"]
    assert "cores" in found["machine"]  # this machine has no GPU: its CPU model and cores
    assert found["model"] == "tiny" and found["command"] and found["started"]
    # the hash is over the resolved config the run consumed
    config = {**TINY_RUN, "run": {**TINY_RUN["run"], "idle_sleep": 0.0005, "repeats": 1,
                                  "repeat": 0, "kv_tier_folder": "~/.cache/servelab/kv_blocks"}}  # fmt: skip
    assert found["config_hash"] == config_hash(config)
    assert found["git_commit"] is None or len(found["git_commit"].split("+")[0]) == 40
    # the machine's load while it served: load averages, other processes' share, busy or not
    load = found["machine_load"]
    assert load["cpus"] >= 1 and load["load_average_1m"] >= 0
    assert 0 <= load["other_cpu_pct"] <= 100 and isinstance(load["busy"], bool)


def test_other_processes_cpu_share_is_the_machines_busy_time_less_this_process():
    # 2 cores for 10 s: 20 CPU-seconds; 15 busy, 5 of them ours -> others used 50%
    before = {"total": 100.0, "busy": 40.0, "own": 3.0}
    after = {"total": 120.0, "busy": 55.0, "own": 8.0}
    load = machine_load(before, after)
    assert load["other_cpu_pct"] == 50.0 and load["busy"]
    quiet = machine_load(before, {"total": 120.0, "busy": 46.0, "own": 8.0})  # only ours
    assert quiet["other_cpu_pct"] == 5.0 and not quiet["busy"]
    assert "other_cpu_pct" not in machine_load(None, after)  # no /proc: no share, no verdict
    # shorter than a clock tick: no tick passed on any core, so nothing measurable ran
    instant = machine_load(before, dict(before))
    assert instant["other_cpu_pct"] == 0.0 and not instant["busy"]
    snapshot = cpu_snapshot()
    assert snapshot is None or snapshot["total"] >= snapshot["busy"] >= 0


def test_a_report_marks_runs_from_a_busy_machine(tmp_path):
    for i, share in enumerate((3.0, 80.0)):
        result = run_config(TINY_RUN)
        result.provenance["machine_load"] = {"other_cpu_pct": share, "busy": share >= 25}
        save_run(tmp_path / str(i), result, TINY_RUN, {"overrides": [f"seed={i}"], "choices": {}})
    out = write_report([tmp_path], progress=False)
    text = (out / "summary.md").read_text()
    assert "1 of 2 runs ran on a busy machine" in text and "80%" in text
    rows = (out / "runs.csv").read_text().splitlines()
    assert "other_cpu_pct" in rows[0] and "busy" in rows[0]


def test_the_model_is_named_by_what_was_loaded():
    assert model_name({"model": {"name": "tiny", "path": "/ckpt/Qwen3-0.6B"}}) == "Qwen3-0.6B"
    assert model_name({"model": {"name": "tiny", "path": None}}) == "tiny"
    assert model_name({"model": "tiny-llama"}) == "tiny-llama"


def test_config_hash_ignores_key_order_and_sees_values():
    assert config_hash({"a": 1, "b": {"c": 2}}) == config_hash({"b": {"c": 2}, "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})


def test_a_report_over_two_versions_warns(tmp_path):
    from tests.lab.test_report import write_run

    write_run(tmp_path / "0", ["scheduler=a"], 0.1)
    write_run(tmp_path / "1", ["scheduler=b"], 0.1)
    for folder, version in (("0", "0.1.0"), ("1", "0.2.0")):
        path = tmp_path / folder / "results.json"
        results = json.loads(path.read_text())
        results["provenance"] = {**provenance({}, "tiny"), "servelab": version}
        path.write_text(json.dumps(results))
    text = (write_report([tmp_path]) / "summary.md").read_text()
    assert "Warning: the runs differ in servelab: 0.1.0, 0.2.0" in text
    assert mixed_provenance([{"machine": "x"}, {"machine": "x"}]) == []
