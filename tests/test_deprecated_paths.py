"""Import paths plugin authors used before the package had a folder per concept
keep working for one release, each with a DeprecationWarning naming the new home."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servelab import MOVED_MODULES

# an old path, a name plugin authors imported from it, and where that name lives now
CASES = [
    ("servelab.scheduler_base", "SchedulerCore", "servelab.scheduling.core"),
    ("servelab.contracts.scheduler_base", "SchedulerCore", "servelab.scheduling.core"),
    ("servelab.contracts.scheduler_update", "QueueTransitions", "servelab.scheduling.transitions"),
    ("servelab.scheduling.update", "QueueTransitions", "servelab.scheduling.transitions"),
    ("servelab.scheduling.admission", "queue_key", "servelab.scheduling.transitions"),
    ("servelab.batch", "StepPlan", "servelab.step.plan"),
    ("servelab.batch", "AttentionMetadata", "servelab.step.metadata"),
    ("servelab.batch", "BlockCopies", "servelab.step.plan"),
    ("servelab.sequence", "Sequence", "servelab.step.sequence"),
    ("servelab.sequence", "SamplingParams", "servelab.step.sequence"),
    ("servelab.options", "describe_options", "servelab.registry.options"),
    ("servelab.options", "construct", "servelab.registry.construct"),
    ("servelab.interfaces", "KVAllocator", "servelab.contracts.allocator"),
    ("servelab.interfaces", "AttentionBackend", "servelab.contracts.attention"),
    ("servelab.hookspecs", "hookimpl", "servelab.contracts.hookspecs"),
]


@pytest.mark.parametrize("old,name,home", CASES, ids=[f"{o}.{n}" for o, n, _ in CASES])
def test_an_old_path_still_imports_with_a_warning(old, name, home):
    """In a fresh interpreter, so the module is really imported (and warns) here."""
    script = (
        "import importlib, sys, warnings\n"
        "warnings.simplefilter('error')\n"  # anything but our DeprecationWarning fails
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    from {old} import {name} as obj\n"
        f"assert obj is getattr(importlib.import_module({home!r}), {name!r})\n"
        "messages = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
        f"assert any({old!r} in m and {home!r} in m for m in messages), messages\n"
        # the warning points at the importing line, not at the import machinery
        "assert all(w.filename == '<string>' for w in caught if w.category is DeprecationWarning), [w.filename for w in caught]\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_old_path_is_tested():
    assert {old for old, _, _ in CASES} == set(MOVED_MODULES)


def test_the_new_paths_do_not_warn():
    script = (
        "import warnings\n"
        "warnings.simplefilter('error')\n"
        "from servelab.scheduling import SchedulerCore\n"
        "from servelab.step.plan import StepPlan\n"
        "from servelab.registry.options import describe_options\n"
        "import servelab.plugins.allocators.paged\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
