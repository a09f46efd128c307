"""`servelab cluster=disaggregated executor=model ...`: a real disaggregated run, one
prefill process and one decode process on this machine (servelab.lab.cluster.pd_processes).

The workload is served as for one engine; results.json, requests.csv and steps.csv go to
the run's folder, each request's row naming the instance that finished it and each step's
row its instance. Times are on one clock (both processes read the machine's monotonic
clock): a handed-over request's TTFT is its first token on the prefill instance, its
inter-token times are the decode instance's. `link` is not modelled here: the K/V really
moves, through torch.distributed (gloo on CPUs, NCCL between CUDA devices).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from servelab.cluster.options import cluster_options, is_disaggregated
from servelab.engine.metrics import RequestRecord, StepRecord
from servelab.engine.summary import summarize
from servelab.errors import ConfigError
from servelab.lab.cluster.pd_processes import PairResult, run_pair
from servelab.lab.provenance import provenance
from servelab.lab.runner import RunResult, model_name, output_digest, print_summary, save_run

TIMES = ("arrival_time", "first_scheduled_time", "first_token_time", "finished_time")


def is_real_pair(config: Mapping) -> bool:
    """A disaggregated cluster on a real executor (not `executor=simulated`)."""
    executor = config.get("executor") or "model"
    name = executor.get("name") if isinstance(executor, Mapping) else executor
    return is_disaggregated(cluster_options(config.get("cluster"))) and name != "simulated"


def run_pair_job(config: dict, meta: dict, folder: Path) -> dict:
    options = cluster_options(config.get("cluster"))
    if (options["prefill"], options["decode"]) != (1, 1):
        raise ConfigError(
            "a real disaggregated run is one prefill and one decode process: set "
            f"cluster.prefill=1 cluster.decode=1 (got {options['prefill']} and "
            f"{options['decode']}), or executor=simulated for more instances"
        )
    started = provenance(config, model_name(config))
    if options["backend"] == "ray":
        from servelab.cluster.ray_replicas import connect
        from servelab.lab.cluster.pd_ray import run_pair_ray

        connect(options["ray_address"])
        result = run_pair_ray(config, transfer=options["transfer"],
                              kv_transport=options["kv_transport"])  # fmt: skip
    else:
        result = run_pair(config, transfer=options["transfer"])
    records, steps = joined_records(result)
    per_instance = [([r for r, n in records if n == name], [s for s, n in steps if n == name])
                    for name in ("prefill", "decode")]  # fmt: skip
    summary = summarize([r for r, _ in records], [s for s, _ in steps], per_instance)
    tokens = {rid: [out["token_ids"]] for rid, out in result.outputs.items()}
    summary["output_digest"] = output_digest(tokens)
    summary.update(
        transfers=result.prefill["sent"],
        kv_bytes_sent=result.prefill["kv_bytes"],
        decode_max_waiting=result.decode["max_waiting"],
        decode_preempted=result.decode["preempted"],
        distributed_backend=result.prefill["backend"],
        handoff_ms_mean=1e3 * _mean(result.decode["handoff_s"]),
        handoff_ms_max=1e3 * max(result.decode["handoff_s"], default=0.0),
    )
    rows = [_Row(r, instance) for r, instance in records]
    save_run(folder, RunResult(None, summary, rows, [_Step(s, i) for s, i in steps], started),
             config, meta)  # fmt: skip
    print_summary(summary, title=f"cluster=disaggregated (two processes)\n{folder}")
    return summary


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def joined_records(result: PairResult) -> tuple[list, list]:
    """Every finished request's record (the instance that finished it) and every step,
    their times moved onto one clock whose origin is the earlier instance's."""
    origin = min(result.prefill["t0"], result.decode["t0"])
    records, steps = [], []
    for name, role in (("prefill", result.prefill), ("decode", result.decode)):
        shift = role["t0"] - origin
        finished_here = {r for r, o in result.outputs.items() if o["instance"] == name}
        for raw in role["records"]:
            if raw["request_id"] not in finished_here:
                continue  # a handed-over request's prefill-only record: the decode one counts
            record = RequestRecord(**raw)
            for key in TIMES:
                value = getattr(record, key)
                setattr(record, key, None if value is None else value + shift)
            record.token_times = [t + shift for t in record.token_times]
            records.append((record, name))
        for raw in role["step_records"]:
            known = set(StepRecord.__dataclass_fields__)
            step = StepRecord(**{k: v for k, v in raw.items() if k in known and k != "extra"})
            step.start_time += shift
            steps.append((step, name))
    steps.sort(key=lambda pair: pair[0].start_time)
    return records, steps


class _Row:
    def __init__(self, record: RequestRecord, instance: str) -> None:
        self.record, self.instance = record, instance

    def csv_row(self) -> dict:
        return {**self.record.csv_row(), "instance": self.instance}


class _Step:
    def __init__(self, step: StepRecord, instance: str) -> None:
        self.step, self.instance = step, instance

    def row(self) -> dict:
        return {**self.step.row(), "instance": self.instance}
