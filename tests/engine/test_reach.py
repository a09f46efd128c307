"""What the engine package may reach, read from its source (no run needed).

`x._name` only on `self`: the engine, its loop, its helpers and the serving front
end reach each other and the parts through public methods and properties. And
a step has one representation, the plan's rows: the decode batch that stood
beside them (`StepPlan.decodes` and the row lists kept with it) is gone from
every module."""

from __future__ import annotations

import ast
from pathlib import Path

from servelab.contracts.executor import Executor
from servelab.step.plan import StepPlan

CORE = Path(__file__).resolve().parents[2] / "core"
ENGINE_FILES = sorted((CORE / "engine").glob("*.py"))
# the fields and module of the second step representation (a decode batch beside the
# plan's items) that the plan's rows replaced: none may come back
OLD_FIELDS = ("items", "scheduled", "decodes", "decode_seqs", "decode_seq_ids", "decode_starts")
OLD_MODULE = "servelab.step.decode_batch"


def private_reaches(source: str) -> list[str]:
    """`line .name` for each `x._name` whose `x` is not `self` or `cls`."""
    return [
        f"{node.lineno} .{node.attr}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]


def old_representation_reads(source: str) -> list[str]:
    """`line name` for each read of a replaced plan field and import of its module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in OLD_FIELDS[2:]:
            found.append(f"{node.lineno} .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(OLD_MODULE):
            found.append(f"{node.lineno} from {node.module}")
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno} import {a.name}" for a in node.names if a.name.startswith(OLD_MODULE)
            ]
    return found


def test_the_engine_package_and_the_front_end_touch_no_private_member_of_another_object():
    files = ENGINE_FILES + [CORE / "llm.py"] + sorted((CORE / "serve").glob("*.py"))
    assert CORE / "engine" / "handover.py" in files  # the list is the real folder
    reached = [f"{p.name}:{hit}" for p in files for hit in private_reaches(p.read_text())]
    assert reached == []


def test_a_step_has_one_representation():
    """The plan is rows; no decode batch beside it, read anywhere in the source."""
    plan = StepPlan()
    assert not [name for name in OLD_FIELDS if hasattr(plan, name)]
    assert not (CORE / "step" / "decode_batch.py").exists()
    files = sorted(CORE.rglob("*.py")) + sorted((CORE.parent / "plugins").rglob("*.py"))
    read = [f"{p.name}:{hit}" for p in files for hit in old_representation_reads(p.read_text())]
    assert read == []


def executor_reaches(source: str, allowed: set[str]) -> list[str]:
    """`line .name` for each `<x>.executor.name` outside `allowed`, and `line getattr`
    for each `getattr(<x>.executor, ...)` (a reach the contract cannot check)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "executor"
            and node.attr not in allowed
        ):
            found.append(f"{node.lineno} .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and isinstance(node.args[0], ast.Attribute)
            and node.args[0].attr == "executor"
        ):
            found.append(f"{node.lineno} {node.func.id}")
    return found


def test_core_reaches_an_executor_only_through_its_contract():
    """The engine, the handover, the CLI, serving, the lab and the cluster read an
    executor only through `Executor`: no runner, KV tensors or model behind its back."""
    allowed = set(dir(Executor)) | set(Executor.__annotations__)
    files = [CORE / "cli.py"] + [
        p for folder in ("engine", "serve", "lab", "cluster") for p in (CORE / folder).glob("*.py")
    ]
    reached = [f"{p.name}:{hit}" for p in files for hit in executor_reaches(p.read_text(), allowed)]
    assert reached == []
    reaches = "engine.executor.runner\ngetattr(self.executor, 'tp', 1)"
    assert executor_reaches(reaches, allowed) == ["1 .runner", "2 getattr"]


def test_both_checks_can_fail():
    assert private_reaches("engine.metrics._token_steps[i] = [engine._step_index]") == [
        "1 ._token_steps",
        "1 ._step_index",
    ]
    assert private_reaches("self._step_index += 1") == []
    source = (
        "ids = plan.decode_seq_ids\n"
        "from servelab.step.decode_batch import DecodeBatch\n"
        "import servelab.step.decode_batch\n"
        "n = plan.num_decodes\n"  # the rows' count of decodes: allowed
    )
    assert sorted(old_representation_reads(source)) == [
        "1 .decode_seq_ids",
        "2 from servelab.step.decode_batch",
        "3 import servelab.step.decode_batch",
    ]
