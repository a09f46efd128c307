"""The wheel ships every source package, every config file and the C++ sources.

`setup.py` computes the package list from the folders, so a new folder can
never be silently left out; this test builds the wheel from a copy of the
source tree, with a probe package and a probe config sub-folder added, and
compares its contents with a walk of that tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Source folder -> its path inside the wheel (the mapping setup.py makes).
ROOTS = {"core": "servelab", "plugins": "servelab/plugins", "conf": "servelab/conf"}
BUILD_FILES = ("setup.py", "pyproject.toml", "README.md")
PROBES = {
    "core/zz_packaging_probe/__init__.py": '"""A package folder the test adds."""\n',
    "conf/zz_packaging_probe/nested/probe.yaml": "name: probe\n",
    "core/zz_packaging_probe/csrc/probe.h": "#pragma once\n",
    "core/zz_packaging_probe/csrc/probe.cpp": '#include "probe.h"\n',
}
# The C++ kernels' sources, built on the user's machine from the installed package.
KERNEL_SOURCES = ("simd.h", "cpu_linear.h", "cpu_fused.h", "cpu_paged.h", "cpu_linear.cpp")
KERNEL_SOURCES += ("cpu_fused.cpp", "cpu_paged.cpp", "cpu_decoder.cpp")


def copy_sources(target: Path) -> None:
    """The files a build reads, without caches or build leftovers of the working tree."""
    for name in BUILD_FILES:
        if (REPO / name).exists():
            shutil.copy2(REPO / name, target / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ROOTS:
        shutil.copytree(REPO / folder, target / folder, ignore=ignore)
    for relative, text in PROBES.items():
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        (target / relative).write_text(text)


def build_wheel(source: Path, out: Path) -> Path:
    # --no-build-isolation and --no-deps: offline, with the setuptools of this venv.
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    result = subprocess.run(
        [*command, "--no-index", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = out.glob("servelab-*.whl")
    return wheel


def wheel_path(relative: Path) -> str:
    """`core/model/x.py` -> `servelab/model/x.py`."""
    folder, *rest = relative.parts
    return "/".join([ROOTS[folder], *rest])


def is_cpp_source(relative: Path) -> bool:
    return relative.parent.name == "csrc" and relative.suffix in (".h", ".cpp")


def expected_files(source: Path) -> set[str]:
    """Every .py of a package folder, every conf .yaml and every csrc/*.h and
    *.cpp, as wheel paths."""
    expected = set()
    for folder in ROOTS:
        for path in (source / folder).rglob("*"):
            relative = path.relative_to(source)
            if any(part.startswith((".", "__")) for part in relative.parent.parts):
                continue  # hidden folders and caches are not packages (setup.py skips them)
            if path.suffix == ".py" or (folder == "conf" and path.suffix == ".yaml"):
                expected.add(wheel_path(relative))
            elif is_cpp_source(relative):
                expected.add(wheel_path(relative))
    return expected


def test_wheel_ships_every_package_and_config(tmp_path):
    source, out = tmp_path / "src", tmp_path / "dist"
    source.mkdir()
    copy_sources(source)

    wheel = build_wheel(source, out)
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())

    expected = expected_files(source)
    assert {wheel_path(Path(p)) for p in PROBES} <= expected  # the walk sees the probes
    assert {f"servelab/kernels/csrc/{name}" for name in KERNEL_SOURCES} <= expected
    missing = sorted(expected - shipped)
    assert missing == [], f"the wheel misses {missing}"
    # Only servelab and its metadata: no tests, examples or build leftovers.
    # A csrc folder ships its C++ sources, and nothing else.
    assert not [name for name in shipped if "/csrc/" in name and not is_cpp_source(Path(name))]
    top_level = {name.split("/")[0] for name in shipped} - {"servelab"}
    assert len(top_level) == 1 and top_level.pop().endswith(".dist-info")
