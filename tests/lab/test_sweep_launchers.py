"""A sweep gives the same runs whichever of Hydra's launchers ran its jobs: the joblib
launcher (local processes), the Ray launcher (on a local Ray it starts, or on a running
one it joins with `address=auto`) and the submitit launcher (`submitit_local`: jobs as
submitit runs them on SLURM, in local processes). Under executor=simulated a job's figures
are a function of its config, so each job's results.json is compared exactly, keyed by its
overrides, and `servelab-report` over each sweep folder writes the same tables. No process
a test's sweep started outlives the test: each one carries a marker in its environment,
and the test looks for it in /proc afterwards."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
# four jobs on a virtual clock; the report is written once, by servelab-report
SWEEP = ["executor=simulated", "hardware=cpu-local", "scheduler=static,continuous",
         "attention=padded,per_request", "report.plots=none", "report.after_sweep=false"]  # fmt: skip
# what differs between two runs of one job (results.json's provenance): the command line
# that launched it, when it started, and how busy the machine was meanwhile
RUN_DEPENDENT = ("command", "started", "machine_load")
# runs.csv: each run's folder (compared relative to the sweep's) and its machine_load
RUN_DEPENDENT_COLUMNS = ("other_cpu_pct", "load_average_1m", "busy")
MARK = "SERVELAB_TEST_PROCESS_MARK"  # in the environment of every process a test starts


def sweep(folder: Path, *overrides: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [str(BIN / "servelab"), "-m", *overrides, f"hydra.sweep.dir={folder}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def jobs(folder: Path) -> dict[frozenset[str], dict]:
    """Each job's results.json, keyed by its overrides, less what differs from run to run."""
    found = {}
    for path in folder.glob("*/results.json"):
        results = json.loads(path.read_text())
        for key in RUN_DEPENDENT:
            results["provenance"].pop(key, None)
        found[frozenset(results["overrides"])] = results
    return found


def report(folder: Path) -> dict[str, object]:
    """`servelab-report FOLDER`'s tables: summary.csv and summary.md as written, runs.csv
    less what differs from run to run."""
    done = subprocess.run([str(BIN / "servelab-report"), str(folder)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    runs = []
    with open(folder / "runs.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            row["run"] = str(Path(row["run"]).relative_to(folder))
            runs.append({k: v for k, v in row.items() if k not in RUN_DEPENDENT_COLUMNS})
    return {"summary.csv": (folder / "summary.csv").read_text(), "runs.csv": runs,
            "summary.md": (folder / "summary.md").read_text()}  # fmt: skip


def marked(marker: str) -> dict[int, str]:
    """The processes whose environment holds the marker: pid -> command line."""
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        try:
            if f"{MARK}={marker}".encode() not in environ.read_bytes().split(b"\0"):
                continue
            command = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if pid != os.getpid():
            found[pid] = command.decode(errors="replace").strip()
    return found


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    """The environment for a test's sweeps (RAY_ADDRESS left out: each test says which Ray);
    after the test, no process that carries its marker may remain (Ray's raylet, GCS server
    and workers included). Any that do are killed, by pid, and the test fails."""
    marker = uuid.uuid4().hex
    environment = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    yield {**environment, MARK: marker}
    deadline = time.monotonic() + 30  # Ray's shutdown signals its processes, then waits
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def ray_temp() -> Iterator[str]:
    """A Ray session folder of the test's own (short: Ray's socket paths must fit 107
    characters), so its Ray neither finds nor is found by another one on the machine."""
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def joblib_sweep(tmp_path_factory) -> tuple[dict, dict]:
    """The sweep on the joblib launcher: its jobs and its report."""
    folder = tmp_path_factory.mktemp("joblib")
    done = sweep(folder, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *SWEEP,
                 env=dict(os.environ))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = jobs(folder)
    assert len(found) == 4 and all(job["status"] == "ok" for job in found.values())
    return found, report(folder)


@pytest.mark.slow  # starts a local Ray (about 10 s on 2 cores), then four jobs on it
def test_the_ray_launcher_on_a_local_ray_gives_the_joblib_runs(
    tmp_path, env, ray_temp, joblib_sweep
):
    folder = tmp_path / "ray"
    ray = ["hydra/launcher=ray", "hydra.launcher.ray.init.address=local",
           "hydra.launcher.ray.init.num_cpus=2", f"+hydra.launcher.ray.init._temp_dir={ray_temp}"]  # fmt: skip
    done = sweep(folder, *ray, *SWEEP, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Started a local Ray instance" in done.stderr
    assert jobs(folder) == joblib_sweep[0]
    assert report(folder) == joblib_sweep[1]
    # the Ray the sweep started ended with it (the env fixture checks no process is left)


@pytest.mark.slow  # four jobs in four processes
def test_the_submitit_local_launcher_gives_the_joblib_runs(tmp_path, env, joblib_sweep):
    folder = tmp_path / "submitit"
    done = sweep(folder, "hydra/launcher=submitit_local", *SWEEP, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((folder / ".submitit").glob("*/*_result.pkl"))) == 4  # submitit ran them
    assert jobs(folder) == joblib_sweep[0]
    assert report(folder) == joblib_sweep[1]


# a running Ray, as `ray start` leaves one: up until its stdin closes, then shut down
RUNNING_RAY = """
import os, sys, ray
ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=sys.argv[1],
         object_store_memory=100 * 2**20, log_to_driver=False)
print(ray.get_runtime_context().gcs_address, os.environ.get("RAY_AUTH_MODE", ""), flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.mark.slow  # a local Ray, and two sweeps that join it
def test_the_ray_launcher_joins_a_running_ray_and_reports_failed_jobs(
    tmp_path, env, ray_temp, joblib_sweep
):
    running = subprocess.Popen([sys.executable, "-c", RUNNING_RAY, ray_temp], env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert running.stdout is not None and running.stdin is not None
        address, auth_mode = running.stdout.readline().split(" ")
        # a driver given the address joins with the Ray's authentication mode (Ray's default
        # for a Ray it starts: a token, which it keeps in ~/.ray)
        joined = {**env, "RAY_ADDRESS": address, "RAY_AUTH_MODE": auth_mode.strip() or "disabled"}
        join = ["hydra/launcher=ray", "hydra.launcher.ray.init.address=auto"]
        folder = tmp_path / "ray"
        done = sweep(folder, *join, *SWEEP, env=joined)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Connecting to existing Ray cluster" in done.stderr
        assert "Started a local Ray instance" not in done.stderr
        assert jobs(folder) == joblib_sweep[0]
        assert report(folder) == joblib_sweep[1]
        # jobs that fail on the cluster: the sweep, launched here, names them and exits 1
        failing = tmp_path / "failing"
        done = sweep(failing, *join, "allocator.block_size=0", *SWEEP[:3], env=joined)
        assert done.returncode == 1, done.stderr[-3000:]
        assert (
            "servelab: 2 of 2 jobs failed: job 1 scheduler=static, job 2 scheduler=continuous"
            in done.stderr.splitlines()
        )
    finally:
        running.communicate(timeout=120)  # closes its stdin: the Ray shuts down
    assert running.returncode == 0
