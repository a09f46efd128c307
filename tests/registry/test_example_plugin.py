"""The example plugin, examples/servelab-sjf, as a user gets it: installed with
pip, then picked on the command line, listed by `servelab-plugins`, its own
test suite passing, and its scheduler doing what it is for.

pip installs it with `--target` into a private folder that only this module's
subprocesses (through PYTHONPATH) and tests (through sys.path) see, and the
finalizer removes it: other test modules running meanwhile, in this process
or in parallel workers, never see the plugin.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from servelab import SamplingParams, build_engine
from servelab.registry import listing as plugins_cli
from servelab.registry import plugin_manager
from servelab.scheduling import SchedulingPolicy

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "servelab-sjf"
DIST_NAME = "servelab-sjf"
MODULE = "servelab_sjf"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the example: pip builds in the source folder and pytest caches
    there, so the repository's copy stays clean."""
    copy = tmp_path_factory.mktemp("source") / "servelab-sjf"
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(EXAMPLE, copy, ignore=ignore)
    return copy


@pytest.fixture(scope="module")
def installed(tmp_path_factory, source):
    """pip-installs the example; yields the install folder."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--target", str(target), str(source)],
        check=True,
    )  # fmt: skip
    yield target
    shutil.rmtree(target, ignore_errors=True)  # the uninstall: nothing else points there


@pytest.fixture(scope="module")
def version(installed) -> str:
    """The installed distribution's version, read from its own metadata."""
    (dist,) = importlib.metadata.distributions(path=[str(installed)])
    assert dist.metadata["Name"] == DIST_NAME
    return dist.version


def env_with(installed: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in [str(installed), os.environ.get("PYTHONPATH", "")] if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def script(name: str) -> list[str]:
    """A console script of this environment."""
    path = BIN / name
    assert path.exists(), f"console script {name} is not installed next to {sys.executable}"
    return [str(path)]


def run(cmd: list[str], env: dict[str, str], cwd: Path | None = None, timeout: float = 120):
    result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


# -- the command line


def test_servelab_runs_scheduler_sjf(installed, tmp_path):
    trace = tmp_path / "trace.jsonl"
    cmd = script("servelab") + [
        "scheduler=sjf",
        "workload=mixed_lengths",
        "engine.num_threads=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    result = run(cmd, env_with(installed, SERVELAB_SJF_TRACE=str(trace)))
    assert "sjf" in result.stdout
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert steps and all("step" in s and "scheduler" in s for s in steps)
    assert any(s["scheduler"].get("sjf_steps", 0) > 0 for s in steps)  # the sjf scheduler ran


def test_sjf_works_in_a_sweep(installed, tmp_path):
    trace = tmp_path / "trace.jsonl"
    cmd = script("servelab") + [
        "-m",
        "scheduler=continuous,sjf",
        "workload=mixed_lengths",
        "engine.num_threads=1",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    run(cmd, env_with(installed, SERVELAB_SJF_TRACE=str(trace)))
    runs = {json.loads(line)["run"] for line in trace.read_text().splitlines()}
    assert len(runs) == 2  # the tracer saw both jobs' engines
    assert len([p for p in (tmp_path / "sweep").iterdir() if p.is_dir()]) == 2


def test_servelab_plugins_lists_sjf_with_its_distribution(installed, version):
    listing = run(script("servelab-plugins"), env_with(installed)).stdout
    schedulers = listing.split("allocator:")[0]  # the scheduler section comes first
    (line,) = [ln for ln in schedulers.splitlines() if ln.split()[:1] == ["sjf"]]
    assert f"{DIST_NAME} {version}" in line


def test_plugins_cli_lists_sjf_options_and_observer(installed, version, sjf_registered):
    # the same listing through servelab.registry.listing, checked field by field
    from servelab_sjf import ShortestJobFirst

    cmd = [sys.executable, "-m", "servelab.registry.listing", "--json"]
    listing = json.loads(run(cmd, env_with(installed)).stdout)
    (sjf,) = [p for p in listing["parts"]["scheduler"] if p["name"] == "sjf"]
    assert sjf["origin"] == f"{DIST_NAME} {version}"
    own = inspect.signature(ShortestJobFirst.__init__).parameters
    base = inspect.signature(SchedulingPolicy.__init__).parameters
    assert sjf["options"] == {
        "predictor": own["predictor"].default,
        "ageing": own["ageing"].default,
        "admission": base["admission"].default,
        "order": base["order"].default,
    }
    (hooks,) = [h for h in listing["hooks"] if h["origin"] == f"{DIST_NAME} {version}"]
    assert {"servelab_step_end", "servelab_register_configs"} <= set(hooks["hooks"])
    assert listing["failed"] == []


def test_plugins_cli_reports_a_plugin_that_failed_to_load(on_plugin_path, capsys):
    broken = Path(__file__).parent / "fake_dists" / "broken"
    (metadata,) = broken.glob("*.dist-info/METADATA")
    fields = dict(ln.split(": ", 1) for ln in metadata.read_text().splitlines() if ": " in ln)
    on_plugin_path(broken, "servelab_fake_broken")
    plugins_cli.main([])
    listing = capsys.readouterr().out
    failed = listing.split("plugins that failed to load:", 1)[1]
    assert f"({fields['Name']} {fields['Version']})" in failed
    assert "ModuleNotFoundError" in failed and "servelab_fake_missing_dependency" in failed
    assert "continuous" in listing.split("failed", 1)[0]  # the rest still loaded


def test_example_package_tests_pass(installed, source):
    # the plugin's own suite, in its own folder, against the installed package
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    result = run(cmd, env_with(installed), cwd=source, timeout=300)
    assert " passed" in result.stdout and "failed" not in result.stdout


# -- what sjf is for


@pytest.fixture
def sjf_registered(installed, on_plugin_path):
    """This process's plugin manager, rebuilt with the installed example on sys.path."""
    on_plugin_path(installed, MODULE)
    assert plugin_manager.registered("scheduler")["sjf"].origin.startswith(DIST_NAME)


def mean_latency_in_steps(scheduler: str, output_lengths: list[int]) -> float:
    """All requests arrive together; a request's latency is the number of the
    engine step that finished it. Steps, not seconds: the comparison must not
    depend on how busy this machine is."""
    engine = build_engine(
        {
            "model": "tiny",
            "scheduler": scheduler,
            "engine": {"max_num_seqs": 2, "num_threads": 1, "dtype": "float32"},
        }
    )
    rng = np.random.default_rng(0)
    for i, n in enumerate(output_lengths):
        prompt = rng.integers(3, 200, size=6).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(prompt, params, request_id=f"r{i}")
    finished_at: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            finished_at[out.request_id] = step
    assert len(finished_at) == len(output_lengths)
    return sum(finished_at.values()) / len(finished_at)


def test_sjf_lowers_mean_latency_against_fcfs(sjf_registered):
    lengths = np.random.default_rng(1).choice([1, 2, 4, 8, 16, 32], size=12).tolist()
    fcfs = mean_latency_in_steps("continuous", lengths)
    sjf = mean_latency_in_steps("sjf", lengths)
    assert sjf < fcfs, f"sjf {sjf:.1f} steps vs continuous {fcfs:.1f} steps, lengths {lengths}"
