"""servelab's kernel cache (`servelab.kernels.cpp_extension`): keyed right, locked, warm.

The key changes with every ingredient of a binary (sources and the headers
they include, flags, torch and its C++ ABI, Python, the CPU), checked on the
key function with injected values. The builds use a tiny throwaway extension
(a pybind11 function, seconds to compile) in a cache under `tmp_path`: another
toolchain builds beside a first build and leaves it untouched, a warm cache
loads with the compiler patched out, and two processes started together build
once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from servelab.kernels import cpp_extension
from servelab.kernels.cpp_extension import Toolchain, build_key, load_extension

REPO = Path(__file__).resolve().parents[2]
HEADER = "inline int add(int a, int b) { return a + b; }\n"
SOURCE = """#include <pybind11/pybind11.h>
#include "tiny.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""
TOOLCHAIN = Toolchain(
    torch="2.13.0+cpu",
    cxx11_abi=True,
    python="3.11.7",
    python_abi="cpython-311 cpython-311-x86_64-linux-gnu",
    machine="x86_64",
    cpu="model name: Some CPU; flags: fpu sse sse2 avx2",
    compiler="c++ /usr/bin/c++",
    environment="/home/user/project/.venv",
)

needs_a_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None,
    reason="needs a C++ compiler and ninja",
)


def tiny_sources(folder: Path) -> Path:
    """The tiny extension's .cpp (and the header it includes) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.h").write_text(HEADER)
    (folder / "tiny.cpp").write_text(SOURCE)
    return folder / "tiny.cpp"


def key_of(cpp: Path, **changes) -> str:
    options = {"cflags": ("-O3",), "ldflags": (), "toolchain": TOOLCHAIN}
    options.update(changes)
    return build_key("tiny", [cpp], include_dirs=[cpp.parent], **options)[0]


def fingerprint(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


# -- the key --------------------------------------------------------------------------


def test_the_key_is_stable_and_says_what_went_into_it(tmp_path):
    cpp = tiny_sources(tmp_path)
    key, ingredients = build_key("tiny", [cpp], include_dirs=[tmp_path], toolchain=TOOLCHAIN)
    assert key == build_key("tiny", [cpp], include_dirs=[tmp_path], toolchain=TOOLCHAIN)[0]
    assert len(key) == 16 and int(key, 16) >= 0
    assert set(ingredients["sources"]) == {"tiny.cpp", "tiny.h"}  # the included header too
    assert ingredients["torch"] == "2.13.0+cpu" and ingredients["cxx11_abi"] is True
    assert ingredients["python"] == "3.11.7" and "sse2" in ingredients["cpu"]
    assert ingredients["cflags"] == list(cpp_extension.CFLAGS)


@pytest.mark.parametrize(
    "change",
    [
        {"cflags": ("-O2",)},
        {"cflags": ("-O3", "-march=native")},
        {"ldflags": ("-fopenmp",)},
        {"toolchain": dataclasses.replace(TOOLCHAIN, torch="2.12.0+cpu")},
        {"toolchain": dataclasses.replace(TOOLCHAIN, cxx11_abi=False)},
        {"toolchain": dataclasses.replace(TOOLCHAIN, python="3.12.4")},
        {"toolchain": dataclasses.replace(TOOLCHAIN, python_abi="cpython-313t x")},
        {"toolchain": dataclasses.replace(TOOLCHAIN, cpu=TOOLCHAIN.cpu + " avx512f")},
        {"toolchain": dataclasses.replace(TOOLCHAIN, machine="aarch64")},
        {"toolchain": dataclasses.replace(TOOLCHAIN, compiler="clang++ /usr/bin/clang++")},
        {"toolchain": dataclasses.replace(TOOLCHAIN, environment="/home/user/other-venv")},
    ],
    ids=lambda change: next(iter(change)) + ":" + str(next(iter(change.values())))[:40],
)
def test_the_key_changes_with_the_flags_and_the_toolchain(tmp_path, change):
    cpp = tiny_sources(tmp_path)
    assert key_of(cpp, **change) != key_of(cpp)


@pytest.mark.parametrize("edited", ["tiny.cpp", "tiny.h"])
def test_the_key_changes_with_a_source_or_an_included_header(tmp_path, edited):
    cpp = tiny_sources(tmp_path)
    before = key_of(cpp)
    (tmp_path / "unrelated.h").write_text("// not included\n")
    assert key_of(cpp) == before  # only what the build reads counts
    (tmp_path / edited).write_text((tmp_path / edited).read_text() + "// edited\n")
    assert key_of(cpp) != before


def test_the_kernels_keys_cover_every_header_they_include():
    csrc = cpp_extension.CSRC
    names = {p.name for p in cpp_extension.included_files([csrc / "cpu_decoder.cpp"], [csrc])}
    assert names == {
        "cpu_decoder.cpp", "cpu_linear.h", "cpu_gemv_bf16.h", "cpu_fused.h", "cpu_paged.h", "simd.h"
    }
    names = {p.name for p in cpp_extension.included_files([csrc / "cpu_paged.cpp"], [csrc])}
    assert names == {"cpu_paged.cpp", "cpu_paged.h", "cpu_prefill_bf16.h", "simd.h"}


def test_the_current_toolchain_describes_this_machine():
    import torch

    toolchain = Toolchain.current()
    assert toolchain.torch == torch.__version__
    assert toolchain.cxx11_abi == torch._C._GLIBCXX_USE_CXX11_ABI
    assert toolchain.python == ".".join(map(str, sys.version_info[:3]))
    assert sys.implementation.cache_tag in toolchain.python_abi
    assert toolchain.environment == str(Path(sys.prefix).resolve())
    assert toolchain.cpu  # /proc/cpuinfo's model and flags, or platform's machine
    if Path("/proc/cpuinfo").exists() and "flags" in Path("/proc/cpuinfo").read_text():
        assert "flags: " in toolchain.cpu


def test_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("SERVELAB_KERNEL_CACHE", str(tmp_path / "mine"))
    assert cpp_extension.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("SERVELAB_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpp_extension.cache_root() == tmp_path / "xdg" / "servelab" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cpp_extension.cache_root() == Path.home() / ".cache" / "servelab" / "kernels"


# -- builds ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny extension built once into a fresh cache: (cache root, source, folder)."""
    root = tmp_path_factory.mktemp("cache")
    cpp = tiny_sources(tmp_path_factory.mktemp("src"))
    module = load_extension("tiny", [cpp], include_dirs=[cpp.parent], root=root)
    assert module.add(2, 3) == 5
    (folder,) = root.iterdir()
    return root, cpp, folder


@needs_a_compiler
def test_a_build_lands_in_its_key_folder_with_key_json(built):
    root, cpp, folder = built
    key, ingredients = build_key("tiny", [cpp], include_dirs=[cpp.parent])
    assert folder == root / f"tiny-{key}"
    record = json.loads((folder / "key.json").read_text())
    assert record["key"] == key and record["ingredients"] == ingredients
    assert (folder / record["binary"]).is_file()


@needs_a_compiler
def test_another_environment_builds_beside_and_leaves_the_first_untouched(built, monkeypatch):
    root, cpp, first = built
    binary = first / json.loads((first / "key.json").read_text())["binary"]
    before = fingerprint(binary)
    other = dataclasses.replace(Toolchain.current(), environment="/elsewhere/another-venv")

    module = load_extension("tiny", [cpp], include_dirs=[cpp.parent], toolchain=other, root=root)

    assert module.add(4, 5) == 9
    folders = sorted(root.iterdir())
    assert len(folders) == 2 and first in folders
    (second,) = [f for f in folders if f != first]
    ingredients = json.loads((second / "key.json").read_text())["ingredients"]
    assert ingredients["environment"] == "/elsewhere/another-venv"
    assert fingerprint(binary) == before  # not rebuilt, not touched
    # ...and the first environment still loads its own build warm
    monkeypatch.setattr(cpp_extension, "_compile", compiler_called)
    assert load_extension("tiny", [cpp], include_dirs=[cpp.parent], root=root).add(1, 1) == 2
    assert fingerprint(binary) == before


def compiler_called(*args, **kwargs):
    raise AssertionError("a warm cache must not compile")


@needs_a_compiler
def test_a_warm_cache_loads_without_the_compiler(built, monkeypatch, record_property):
    import torch.utils.cpp_extension

    root, cpp, _ = built
    monkeypatch.setattr(cpp_extension, "_compile", compiler_called)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", compiler_called)
    monkeypatch.setattr(subprocess, "Popen", compiler_called)  # nor any other process

    started = time.perf_counter()
    module = load_extension("tiny", [cpp], include_dirs=[cpp.parent], root=root)
    seconds = time.perf_counter() - started

    assert module.add(20, 22) == 42
    record_property("warm_load_seconds", seconds)  # reported, not asserted
    print(f"warm load: {seconds * 1000:.1f} ms")


RACER = """
import logging, os, sys, time
from pathlib import Path
from servelab.kernels import cpp_extension

logging.basicConfig(level=logging.INFO)
cpp, go, counter = map(Path, sys.argv[1:4])
real = cpp_extension._compile

def counting(*args, **kwargs):
    with open(counter, "a") as out:
        out.write(f"{os.getpid()}\\n")
    return real(*args, **kwargs)

cpp_extension._compile = counting
(go.parent / f"ready-{os.getpid()}").touch()
while not go.exists():  # both processes start building at the same moment
    time.sleep(0.005)
module = cpp_extension.load_extension("tiny", [cpp], include_dirs=[cpp.parent])
print("result", module.add(2, 3))
"""


@needs_a_compiler
def test_two_processes_started_together_build_once(tmp_path):
    cpp = tiny_sources(tmp_path / "src")
    root, go, counter = tmp_path / "cache", tmp_path / "go", tmp_path / "builds"
    script = tmp_path / "racer.py"
    script.write_text(textwrap.dedent(RACER))
    env = {**os.environ, "SERVELAB_KERNEL_CACHE": str(root), "SERVELAB_CPU_KERNEL": "1"}
    racers = [
        subprocess.Popen(
            [sys.executable, str(script), str(cpp), str(go), str(counter)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready-*"))) < 2 and time.monotonic() < deadline:
        assert all(racer.poll() is None for racer in racers), "a racer exited early"
        time.sleep(0.05)
    go.touch()
    outputs = [p.communicate(timeout=300) for p in racers]

    for (out, err), racer in zip(outputs, racers):
        assert racer.returncode == 0, err
        assert "result 5" in out
    assert len(counter.read_text().split()) == 1  # one compile for both
    assert len(list(root.iterdir())) == 1
    assert any("waiting for another process's build" in err for _, err in outputs)
