"""The layering of servelab, as import-linter contracts (pyproject.toml, [tool.importlinter]).

The editable install maps three folders onto one import name (core/ -> servelab,
plugins/ -> servelab.plugins, conf/ -> servelab.conf), and grimp finds a package's modules by
walking its one folder, so a bare `lint-imports` sees core/ only. Every run here lints a staged
copy laid out as one importable package, with the repo's pyproject.toml, in a subprocess whose
path puts the copy first (the in-process `servelab` would shadow it).

Each contract is also broken on purpose, one injected import per case, to prove it can fail.
import-linter counts type-only imports (`exclude_type_checking_imports = false`) but does not
look for cycles inside a layer, so `servelab_import_cycles` reads every import statement itself
(type-only and function-local ones included) and the suite holds the set of cycles empty. Run as a script to lint the working tree from the command line:

    .venv/bin/python tests/test_layering.py [--contract ID ...]
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "pyproject.toml"
# setup.py's ROOTS, as places inside the staged copy
LAYOUT = {"core": "servelab", "plugins": "servelab/plugins", "conf": "servelab/conf"}

LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(config_filename=sys.argv[1], limit_to_contracts=tuple(sys.argv[2:]), "
    "no_cache=True, no_logo=True))"
)


def contracts() -> dict[str, str]:
    """`{id: name}` of the contracts in pyproject.toml, in order."""
    with open(CONFIG, "rb") as f:
        config = tomllib.load(f)
    return {c["id"]: c["name"] for c in config["tool"]["importlinter"]["contracts"]}


def _sources_only(folder: str, names: list[str]) -> list[str]:
    """copytree's ignore: keep the .py files and the folders; grimp reads nothing else."""
    return [
        n
        for n in names
        if n == "__pycache__"
        or (not n.endswith(".py") and not os.path.isdir(os.path.join(folder, n)))
    ]


def stage(root: Path) -> Path:
    """Lay the package's sources out under `root` as one `servelab` package; returns `root`."""
    for folder, place in LAYOUT.items():
        shutil.copytree(REPO / folder, root / place, ignore=_sources_only)
    return root


@dataclass
class Lint:
    returncode: int
    output: str
    kept: dict[str, bool]  # contract id -> kept

    @property
    def broken(self) -> set[str]:
        return {cid for cid, kept in self.kept.items() if not kept}

    def details(self, contract_id: str) -> str:
        """The 'Broken contracts' section of one contract (its import chains)."""
        names = contracts()
        tail = self.output.split("Broken contracts", 1)[-1]
        start = tail.find(f"\n{names[contract_id]}\n")
        if start < 0:
            return ""
        ends = [tail.find(f"\n{n}\n", start + 1) for n in names.values()]
        end = min((e for e in ends if e > start), default=len(tail))
        return tail[start:end]


def lint(root: Path, *contract_ids: str) -> Lint:
    """import-linter with the repo's contracts over the `servelab` staged under `root`."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env.update(COLUMNS="400", NO_COLOR="1", TERM="dumb")  # one line per result, no styling
    proc = subprocess.run(
        [sys.executable, "-c", LINT, str(CONFIG), *contract_ids],
        cwd=root,  # the CLI puts the working directory first on sys.path
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    kept = {}
    for cid, name in contracts().items():
        m = re.search(rf"^{re.escape(name)} (KEPT|BROKEN)\b", output, re.MULTILINE)
        if m:
            kept[cid] = m.group(1) == "KEPT"
    return Lint(proc.returncode, output, kept)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Lint:
    """The contracts over the working tree as it is."""
    return lint(stage(tmp_path_factory.mktemp("layout")))


def test_contracts_hold(baseline):
    assert set(baseline.kept) == set(contracts()), f"not every contract ran:\n{baseline.output}"
    assert not baseline.broken, f"contracts broken: {sorted(baseline.broken)}\n{baseline.output}"
    assert baseline.returncode == 0, baseline.output


@dataclass(frozen=True)
class Break:
    """Append `code` to `file` (created if absent) in the staged copy."""

    file: str
    code: str
    breaks: tuple[str, ...]  # the contract ids this breaks, and no others
    shows: str = ""  # what the report of each of them must show


BREAKS = {
    # the model executor (a plugin) reaches the kernels, so the chain also breaks
    # plugins-not-harness: a plugin would reach the engine through them
    "kernels import engine": Break(
        "servelab/kernels/cpu_linear.py",
        "import servelab.engine.metrics",
        ("layers", "plugins-not-harness"),
        "servelab.kernels.cpu_linear -> servelab.engine.metrics",
    ),
    "lab imports its sibling testing": Break(
        "servelab/lab/workload.py",
        "import servelab.testing.deps",
        ("layers",),
        "servelab.lab.workload -> servelab.testing.deps",
    ),
    # the router proxy sits below the experiment harness; cluster runs are lab.cluster
    "cluster imports the lab": Break(
        "servelab/cluster/dispatch.py",
        "import servelab.lab.workload",
        ("layers",),
        "servelab.cluster.dispatch -> servelab.lab.workload",
    ),
    # a chain breaks every contract it crosses: allocators and plugins import step.sequence,
    # and engine.engine imports torch
    "step imports engine": Break(
        "servelab/step/sequence.py",
        "import servelab.engine.engine",
        ("layers", "allocators-no-torch", "plugins-not-harness"),
        "servelab.step.sequence -> servelab.engine.engine",
    ),
    "a new top-level module with no layer": Break(
        "servelab/utils.py", "", ("layers",), "servelab.utils"
    ),
    "engine imports a built-in": Break(
        "servelab/engine/engine.py",
        "import servelab.plugins.allocators.paged",
        ("core-not-plugins",),
        "servelab.engine.engine -> servelab.plugins.allocators.paged",
    ),
    "plugin manager imports a built-in lazily": Break(
        "servelab/registry/plugin_manager.py",
        "def _builtin():\n    import servelab.plugins.schedulers.static",
        # `draft` builds its parts through the registry: through it, every kind would
        # reach the schedulers
        ("core-not-plugins", "plugin-kinds-independent"),
        "servelab.registry.plugin_manager -> servelab.plugins.schedulers.static",
    ),
    # servelab.testing.oracle does `from servelab import LLM`, so the root's import is core's too
    "servelab/__init__ imports a built-in": Break(
        "servelab/__init__.py",
        "import servelab.plugins.allocators.paged",
        ("root-not-plugins", "core-not-plugins"),
        "servelab -> servelab.plugins.allocators.paged",
    ),
    "an allocator imports torch": Break(
        "servelab/plugins/allocators/paged.py",
        "import torch",
        ("allocators-no-torch",),
        "servelab.plugins.allocators.paged -> torch",
    ),
    "the allocators' package __init__ imports torch": Break(
        "servelab/plugins/allocators/__init__.py",
        "import torch",
        ("allocators-no-torch",),
        "servelab.plugins.allocators -> torch",
    ),
    "step.plan imports torch": Break(
        "servelab/step/plan.py",
        "import torch",
        ("allocators-no-torch",),
        "servelab.step.plan -> torch",
    ),
    "a scheduler imports the lab": Break(
        "servelab/plugins/schedulers/static.py",
        "import servelab.lab.runner",
        ("plugins-not-harness",),
        "servelab.plugins.schedulers.static -> servelab.lab.runner",
    ),
    "a scheduler imports an allocator": Break(
        "servelab/plugins/schedulers/chunked.py",
        "import servelab.plugins.allocators.paged",
        ("plugin-kinds-independent",),
        "servelab.plugins.schedulers.chunked -> servelab.plugins.allocators.paged",
    ),
    # a type-only import is a dependency too (exclude_type_checking_imports = false): a
    # lower layer names a higher one's type as `Any`, a Protocol of its own or in a docstring
    "step imports engine for type checking only": Break(
        "servelab/step/sequence.py",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import servelab.engine.engine",
        ("layers", "allocators-no-torch", "plugins-not-harness"),
        "servelab.step.sequence -> servelab.engine.engine",
    ),
}


def test_every_contract_has_a_break():
    broken_somewhere = {cid for b in BREAKS.values() for cid in b.breaks}
    assert set(contracts()) <= broken_somewhere, "a contract no case breaks: add one to BREAKS"


@pytest.mark.parametrize("case", list(BREAKS), ids=list(BREAKS))
def test_contract_can_fail(case, tmp_path, baseline):
    brk = BREAKS[case]
    root = stage(tmp_path)
    with open(root / brk.file, "a") as f:
        f.write(f"\n{brk.code}\n")

    result = lint(root)

    assert set(result.kept) == set(contracts()), f"not every contract ran:\n{result.output}"
    assert result.broken == baseline.broken | set(brk.breaks), result.output
    for cid in brk.breaks:
        assert contracts()[cid] in result.output
        assert brk.shows in result.details(cid), (
            f"{cid} does not show {brk.shows!r}:\n{result.output}"
        )
    assert (result.returncode != 0) == bool(result.broken), result.output


def _chain_to(module: str, importtime: str) -> list[str]:
    """From `python -X importtime` output: the first import of `module`, outermost first."""
    rows = []
    for line in importtime.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|( *)(\S+)", line)
        if m:
            rows.append((len(m.group(1)), m.group(2)))
    for i, (depth, name) in enumerate(rows):
        if name == module:
            chain = [name]
            for parent_depth, parent in rows[i + 1 :]:  # a parent is printed after its children
                if parent_depth < depth:
                    chain.append(parent)
                    depth = parent_depth
            return chain[::-1]
    return []


def test_allocators_import_without_torch(tmp_path):
    """Run time, for what the static check cannot see (a package __init__ importing torch)."""
    code = (
        "import sys, servelab.plugins.allocators.paged, servelab.plugins.allocators.contiguous\n"
        "import servelab.plugins.allocators.radix\n"
        "print('torch' in sys.modules)\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] == 'servelab')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    torch_loaded, loaded = proc.stdout.splitlines()
    chain = _chain_to("torch", proc.stderr)
    assert torch_loaded == "False", "importing the allocators imports torch: " + " -> ".join(chain)

    # every servelab module that ran must be one the static contract checks as a module
    with open(CONFIG, "rb") as f:
        config = tomllib.load(f)
    (torch_free,) = [
        c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "allocators-no-torch"
    ]
    listed = torch_free["source_modules"]

    def covered(module: str) -> bool:
        return module in listed or any(
            p.endswith(".**") and module.startswith(p[:-2]) for p in listed
        )

    unlisted = [m for m in loaded.split() if not covered(m)]
    assert not unlisted, f"add to allocators-no-torch's source_modules: {unlisted}"


def _module_files(root: Path) -> dict[str, Path]:
    """`{module name: file}` of every servelab module laid out as setup.py maps it."""
    files = {}
    for folder, place in LAYOUT.items():
        for path in (root / folder).rglob("*.py"):
            parts = [*place.split("/"), *path.relative_to(root / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The servelab modules `name` imports anywhere in its file: at the top, in a
    function, under `if TYPE_CHECKING:`, relative or absolute. `from a import b`
    counts `a.b` when it is a module, else `a`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[: (None if path.name == "__init__.py" else -1)]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, *([node.module] if node.module else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in known or base in known:
                    found.add(target if target in known else base)
    return found - {name}


def servelab_import_cycles(root: Path = REPO) -> list[list[str]]:
    """The import cycles among servelab's modules (each a sorted strongly connected
    set of two or more modules, Tarjan's algorithm)."""
    known = _module_files(root)
    graph = {m: sorted(_imported(m, p, known)) for m, p in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(members) > 1:
                cycles.append(sorted(members))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_cycles_type_only_imports_included():
    assert servelab_import_cycles() == []


def test_a_type_only_import_back_is_a_cycle(tmp_path):
    """The check itself can fail: a staged copy where the engine imports its
    builder back under TYPE_CHECKING, and a relative import back from a step module."""
    for folder in LAYOUT:
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=_sources_only)
    with open(tmp_path / "core/engine/engine.py", "a") as f:
        f.write("\nif TYPE_CHECKING:\n    from servelab.engine.build import build_engine\n")
    with open(tmp_path / "core/step/sequence.py", "a") as f:
        f.write("\ndef _late():\n    from . import plan\n")
    cycles = servelab_import_cycles(tmp_path)
    assert ["servelab.engine.build", "servelab.engine.engine"] in cycles
    assert ["servelab.step.plan", "servelab.step.sequence"] in cycles


def main(argv: list[str]) -> int:
    ids = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--contract"]
    with tempfile.TemporaryDirectory() as tmp:
        result = lint(stage(Path(tmp)), *ids)
    print(result.output, end="")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
