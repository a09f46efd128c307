"""docs/plugins.md's "Writing a proposer", held to what works: the package is
built from the page's own blocks (each file's path is named just above its
block), checked in this process with the conformance kit, then installed with
pip (into a private folder, as tests/registry/test_example_plugin.py does) and
used as the page says: `servelab-plugins proposer` prints the lines the page
shows, every `servelab` command the page lists runs with the proposer, and
the package's own tests pass. A change to the kit, the contract or the CLI that
breaks the page's example fails here."""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "plugins.md"
PACKAGE = "servelab-bigram"
MODULE = "servelab_bigram"
BIN = Path(sys.executable).parent


@cache
def section() -> str:
    text = DOC.read_text()
    start = text.index("\n## Writing a proposer\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


@cache
def files() -> dict[str, str]:
    """{path inside the package: its text}, from the blocks whose path the line above names."""
    blocks = re.findall(
        rf"`{PACKAGE}/([^`]+)`[^\n]*:\n\n```\w*\n(.*?)^```", section(), re.DOTALL | re.MULTILINE
    )
    return dict(blocks)


def shown(command: str) -> list[str]:
    """The lines the page shows after `$ <command>`, up to the next command or `...`."""
    block = re.search(r"^\$ pip install .*?^```", section(), re.DOTALL | re.MULTILINE)
    assert block, "the page shows no install-and-use block"
    lines = block.group(0).splitlines()
    start = lines.index(f"$ {command}") + 1
    out = []
    for line in lines[start:]:
        if line.startswith("$ ") or line in ("...", "```"):
            break
        out.append(line)
    return out


def commands() -> list[list[str]]:
    """The `servelab` commands of the page's install-and-use block."""
    block = re.search(r"^\$ pip install .*?^```", section(), re.DOTALL | re.MULTILINE)
    assert block
    return [
        shlex.split(line[2:])
        for line in block.group(0).splitlines()
        if line.startswith("$ servelab ")
    ]


def write_package(folder: Path) -> Path:
    root = folder / PACKAGE
    for path, text in files().items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_the_page_names_the_whole_package():
    assert set(files()) == {"pyproject.toml", f"{MODULE}.py", "tests/test_bigram.py"}
    assert f'bigram = "{MODULE}"' in files()["pyproject.toml"]  # the entry point
    code = files()[f"{MODULE}.py"]
    assert 25 <= len(code.splitlines()) <= 50, "the page promises a proposer of about 30 lines"


# -- in this process: the module as the page writes it, through the kit


@pytest.fixture
def module(tmp_path, monkeypatch):
    root = write_package(tmp_path)
    monkeypatch.syspath_prepend(str(root))
    yield importlib.import_module(MODULE)
    sys.modules.pop(MODULE, None)


def test_the_pages_proposer_passes_the_kit_and_drafts_what_repeats(module):
    from servelab.contracts.proposer import DraftRequest
    from servelab.testing import check_proposer

    report = check_proposer(module.BigramProposer)
    assert report.draft_tokens > 0 and report.preempted > 0
    bigram = module.BigramProposer(k=3, vocab_size=16)
    prompt = [1, 2, 3, 1, 2, 3, 1]
    (draft,) = bigram.propose([DraftRequest(0, "a", prompt, len(prompt), 3)])
    assert draft == [2, 3, 1]  # the cycle it read in the prompt
    outputs_only = module.BigramProposer(learn_prompts=False, vocab_size=16)
    assert outputs_only.propose([DraftRequest(1, "b", prompt, len(prompt), 3)]) == [[]]


def test_the_pages_tests_pass(module):
    tests = {}
    exec(compile(files()["tests/test_bigram.py"], "test_bigram.py", "exec"), tests)
    names = [n for n in tests if n.startswith("test_")]
    assert names
    for name in names:
        tests[name]()


# -- as a user gets it: pip, the command line, the package's own tests


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the package's source folder, the private folder pip installed it into)."""
    source = write_package(tmp_path_factory.mktemp("source"))
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "--target", str(target), str(source)],
        check=True,
    )  # fmt: skip
    return source, target


def env_with(target: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in [str(target), os.environ.get("PYTHONPATH", "")] if p)
    return {**os.environ, "PYTHONPATH": path}


def run(cmd: list[str], env: dict[str, str], cwd: Path | None = None, timeout: float = 300):
    result = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


def script(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"console script {name} is not installed next to {sys.executable}"
    return str(path)


def test_servelab_plugins_prints_what_the_page_shows(installed):
    _, target = installed
    out = run([script("servelab-plugins"), "proposer"], env_with(target)).stdout.splitlines()
    want = shown("servelab-plugins proposer")
    assert want and want[0] == "proposer:"
    at = [out.index(line) if line in out else None for line in want]
    assert None not in at, f"the page shows lines the command does not print:\n{want}\n{out}"
    assert at == sorted(at), "the page shows them in another order"


def test_every_servelab_command_of_the_page_runs_the_proposer(installed, tmp_path):
    _, target = installed
    cmds = commands()
    assert len(cmds) >= 3
    for i, cmd in enumerate(cmds):
        sweep = "-m" in cmd
        folder = tmp_path / f"run{i}"
        where = f"hydra.sweep.dir={folder}" if sweep else f"hydra.run.dir={folder}"
        run([script(cmd[0]), *cmd[1:], "engine.num_threads=1", where], env_with(target))
        overrides = dict(a.split("=", 1) for a in cmd[1:] if "=" in a)
        results = sorted(folder.glob("*/results.json") if sweep else [folder / "results.json"])
        names = overrides["proposer"].split(",")
        assert len(results) == len(names)
        for path in results:
            result = json.loads(path.read_text())
            proposer = result["config"]["proposer"]
            assert proposer["name"] in names
            for key, value in overrides.items():
                if key.startswith("proposer."):
                    option = key.split(".", 1)[1]
                    assert str(proposer[option]).lower() == value, (key, proposer)
            if proposer["name"] == "bigram":
                summary = result["summary"]
                assert summary["spec_draft_tokens"] > 0 and summary["spec_proposer_errors"] == 0


def test_the_package_tests_pass_against_the_installed_package(installed):
    source, target = installed
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    result = run(cmd, env_with(target), cwd=source)
    assert " passed" in result.stdout and "failed" not in result.stdout
