"""The suite asserts what is counted, never the wall clock: a timing claim
flips on a busy machine (two shared cores, a neighbour's build) and a test
that fails that way teaches nothing. This scans every test module for asserts
that compare wall-clock figures and lists them; the list must stay empty.

Flagged: an assert comparing a clock reading (`time.perf_counter()`,
`time.time()`, `time.monotonic()`, or a name computed from one), or comparing a
timed figure (lab/stats.py's `is_counted`: `*_ms`, `*_s`, `*_tok_s`, `*_rps`,
...) read from a run. Not flagged: a wait's deadline (`time.monotonic() <
deadline`: it bounds a hang, it decides no claim), a timed figure against
zero (it was measured at all), equality of timed figures (two runs of one
virtual clock give equal times), configured time budgets (`limit_s`), and
tests under a virtual clock (`executor=simulated`), whose times are a function
of the config.
"""

from __future__ import annotations

import ast
from pathlib import Path

from servelab.lab.stats import is_counted

TESTS = Path(__file__).resolve().parents[1]
CLOCKS = {"perf_counter", "time", "monotonic", "perf_counter_ns", "monotonic_ns"}
# tests whose timed figures come from a virtual clock: exact, not measured
VIRTUAL_CLOCK_MODULES = {
    "lab/test_presets_simulated.py",  # every run on a simulated H100
    "lab/test_public_traces_runs.py",  # its presets run on a simulated H100
    "lab/cluster/test_simulated_cluster.py",
    "lab/cluster/test_disagg_presets.py",  # its presets run on simulated H100s
}
VIRTUAL_CLOCK_MARKS = ("simulated", "SIMULATED", "virtual", "FakeClock", "fake_clock")
CONFIGURED = {"limit_s"}  # time budgets a config sets, not times measured


def _clock_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in CLOCKS and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "time")  # fmt: skip


def _timed_names(node: ast.AST) -> list[str]:
    """Timed figure names a run's summary is read with: run["output_tok_s"], s.ttft_p99_ms."""
    names = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant):
            key = sub.slice.value
            if isinstance(key, str) and not is_counted(key) and key not in CONFIGURED:
                names.append(key)
    return names


def wall_clock_asserts(source: str, path: str = "<test>") -> list[str]:
    """`path:line: text` of each assert that compares the wall clock."""
    tree = ast.parse(source)
    clock_names: set[str] = set()
    for node in ast.walk(tree):  # `elapsed = time.perf_counter() - started`, `started = ...`
        if isinstance(node, ast.Assign) and any(_clock_call(n) for n in ast.walk(node.value)):
            clock_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        text = ast.get_source_segment(source, function) or ""
        virtual = any(mark in text for mark in VIRTUAL_CLOCK_MARKS)
        for node in ast.walk(function):
            if not isinstance(node, ast.Assert):
                continue
            for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                if all(isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn))
                       for op in compare.ops):  # fmt: skip
                    continue
                sides = [compare.left, *compare.comparators]
                if any(isinstance(side, ast.Constant) and side.value == 0 for side in sides):
                    continue  # measured at all: a sign, not a claim
                names = {n.id for side in sides for n in ast.walk(side) if isinstance(n, ast.Name)}
                clocked = any(_clock_call(n) for side in sides for n in ast.walk(side)) or bool(
                    names & clock_names
                )
                if clocked and not any("deadline" in name for name in names):
                    found.append(f"{path}:{node.lineno}: {ast.unparse(node.test)}")
                elif not virtual and _timed_names(compare):
                    found.append(f"{path}:{node.lineno}: {ast.unparse(node.test)}")
    return found


def suite_wall_clock_asserts() -> list[str]:
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        relative = path.relative_to(TESTS).as_posix()
        if relative not in VIRTUAL_CLOCK_MODULES:
            found += wall_clock_asserts(path.read_text(), relative)
    return found


def test_the_suite_asserts_no_wall_clock_comparison():
    assert suite_wall_clock_asserts() == []


def test_the_scan_finds_wall_clock_asserts():
    # what the suite once held: a chunked-prefill claim on measured stalls, a timed bound
    flagged = wall_clock_asserts('''
import time
def test_chunked(runs):
    chunked, whole = runs["chunked"], runs["continuous"]
    assert chunked["longest_stall_ms"] < whole["longest_stall_ms"]
    assert chunked["steps"] < whole["steps"]
def test_fast():
    begin = time.perf_counter()
    work()
    assert time.perf_counter() - begin < 10
def test_waits(deadline):
    assert time.monotonic() < deadline, "the server did not start"
def test_simulated_h100(runs):
    assert runs["a"]["output_tok_s"] >= 1.8 * runs["b"]["output_tok_s"]
''')
    assert [line.split(": ", 1)[0] for line in flagged] == ["<test>:5", "<test>:10"]
