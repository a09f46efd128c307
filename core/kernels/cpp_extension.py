"""Builds servelab's C++ CPU kernels (`csrc/`) once per toolchain and CPU, or says why not.

A build lands in servelab's own cache (`cache_root()`), in a folder named by a
key over everything that decides the binary and the environment it is for
(`build_key`): two virtual environments, or machines with another CPU, never
load or replace each other's builds. A file lock makes processes started together build once;
a warm cache is imported without running the compiler.

The fallback, for every kernel: without a compiler, or with `SERVELAB_CPU_KERNEL=0`
in the environment, `kernel()` is None and one logged line says why; callers
then take their pure-torch path, which computes the same thing.

A first build takes a minute or more, so it is announced: servelab's logger
gets a handler of its own (`announce_handler`) that prints to stderr when the
application has configured no logging (a script calling `LLM()`); where it
has (Hydra, a server), the records go to its handlers instead, printed once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

try:
    import fcntl
except ImportError:  # not POSIX: no lock, concurrent first builds may race
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


class _AnnounceHandler(logging.StreamHandler):
    """Prints servelab's INFO and above to stderr while the root logger has no
    handler (nothing else would show them); otherwise leaves them to the root's."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def announce_handler() -> logging.Handler:
    """Installs (once) the handler on the `servelab` logger and lets INFO through."""
    logger = logging.getLogger("servelab")
    for handler in logger.handlers:
        if isinstance(handler, _AnnounceHandler):
            return handler
    handler = _AnnounceHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler


announce_handler()

SWITCH = "SERVELAB_CPU_KERNEL"  # "0" turns every C++ kernel off
CACHE_ENV = "SERVELAB_KERNEL_CACHE"  # the cache folder, instead of the default
CSRC = Path(__file__).resolve().with_name("csrc")
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
KEY_VERSION = 2  # bump when the way a build is made changes
KEY_FILE = "key.json"  # written last: its presence marks a finished build
LOCK_FILE = "build.lock"  # (torch's own baton inside a build folder is `lock`)

# what `problems()` says when a kernel's build failed or was switched off
BUILD_PROBLEM = "the C++ kernel must build (see the log; SERVELAB_CPU_KERNEL=0 turns it off)"


def placement_problems(device, dtype, dtypes: Sequence) -> list[str]:
    """The constraints every C++ CPU kernel shares: the CPU, one of `dtypes`."""
    found = []
    if device.type != "cpu":
        found.append(f"the device must be the CPU (got {device})")
    if dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        found.append(f"the dtype must be {names} (got {dtype})")
    return found


def kernels_enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def header_constant(header: str, name: str) -> int:
    """The integer `constexpr ... name = N;` in `csrc/<header>`."""
    text = (CSRC / header).read_text()
    found = re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*(\d+)\s*;", text)
    assert found is not None, f"{name} is not defined in {header}"
    return int(found.group(1))


def cache_root() -> Path:
    """`$SERVELAB_KERNEL_CACHE`, else `$XDG_CACHE_HOME/servelab/kernels`, else
    `~/.cache/servelab/kernels`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "servelab" / "kernels"


# /proc/cpuinfo's lines that say which CPU and instruction set: x86, Arm, RISC-V
_CPU_FIELDS = ("model name", "flags", "Features", "CPU implementer", "CPU architecture")
_CPU_FIELDS += ("CPU variant", "CPU part", "isa", "uarch")


@functools.cache
def cpu_description() -> str:
    """What `-march=native` compiles for: the first CPU's model and instruction-set
    lines of /proc/cpuinfo, or `platform.machine()` and `platform.processor()`."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    if fields:
                        break  # the first processor's block is enough
                    continue
                field, _, value = line.partition(":")
                if field.strip() in _CPU_FIELDS:
                    fields.setdefault(field.strip(), " ".join(value.split()))
    if not fields:
        return f"{platform.machine()} {platform.processor()}".strip()
    return "; ".join(f"{field}: {fields[field]}" for field in _CPU_FIELDS if field in fields)


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """What besides the sources and flags decides a build's binary."""

    torch: str  # torch.__version__ (its headers, and its build flags such as -std)
    cxx11_abi: bool  # torch._C._GLIBCXX_USE_CXX11_ABI
    python: str  # the full version
    python_abi: str  # implementation and extension ABI tag, e.g. cpython-311-x86_64-linux-gnu
    machine: str
    cpu: str  # `cpu_description()`
    compiler: str  # $CXX (torch's choice) and where it resolves
    environment: str  # sys.prefix: each virtual environment keeps builds of its own

    @classmethod
    def current(cls) -> Toolchain:
        import torch

        cxx = os.environ.get("CXX", "c++")
        return cls(
            torch=str(torch.__version__),
            cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
            python=platform.python_version(),
            python_abi=f"{sys.implementation.cache_tag} {sysconfig.get_config_var('SOABI')}",
            machine=platform.machine(),
            cpu=cpu_description(),
            compiler=f"{cxx} {shutil.which(cxx) or ''}".strip(),
            environment=str(Path(sys.prefix).resolve()),
        )


def included_files(sources: Sequence[Path], include_dirs: Sequence[Path]) -> list[Path]:
    """`sources` and every file they include in quotes, transitively, found
    beside the including file or in `include_dirs` (the `<...>` system headers
    are the toolchain's: its key entries stand for them)."""
    found: list[Path] = []
    pending = [Path(s).resolve() for s in sources]
    while pending:
        path = pending.pop(0)
        if path in found:
            continue
        found.append(path)
        for name in re.findall(r'^\s*#\s*include\s*"([^"]+)"', path.read_text(), re.M):
            for folder in (path.parent, *include_dirs):
                if (Path(folder) / name).is_file():
                    pending.append((Path(folder) / name).resolve())
                    break
    return found


def build_key(
    name: str,
    sources: Sequence[Path],
    *,
    include_dirs: Sequence[Path] = (),
    cflags: Sequence[str] = CFLAGS,
    ldflags: Sequence[str] = LDFLAGS,
    toolchain: Toolchain | None = None,
) -> tuple[str, dict]:
    """The build folder's key (16 hex digits) and the ingredients it hashes."""
    toolchain = toolchain or Toolchain.current()
    files = {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in included_files(sources, include_dirs)
    }
    ingredients = {
        "key_version": KEY_VERSION,
        "name": name,
        "sources": files,
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        **dataclasses.asdict(toolchain),
    }
    digest = hashlib.sha256(json.dumps(ingredients, sort_keys=True).encode()).hexdigest()
    return digest[:16], ingredients


def _compile(module_name, sources, folder, include_dirs, cflags, ldflags) -> ModuleType:
    """Runs the compiler (through torch's ninja build) and imports the result."""
    from torch.utils.cpp_extension import load

    return load(
        name=module_name,
        sources=[str(s) for s in sources],
        extra_include_paths=[str(d) for d in include_dirs],
        extra_cflags=list(cflags),
        extra_ldflags=list(ldflags),
        build_directory=str(folder),
        verbose=False,
    )


def _import_built(folder: Path) -> ModuleType | None:
    """The finished build in `folder`, imported, or None when there is none."""
    try:
        record = json.loads((folder / KEY_FILE).read_text())
    except (OSError, ValueError):
        return None
    binary = folder / record["binary"]
    if not binary.is_file():
        return None
    spec = importlib.util.spec_from_file_location(record["module"], binary)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Held while a process builds into `folder`; a second one waits here."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_FILE, "a+") as handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("servelab: waiting for another process's build in %s", folder)
                fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def load_extension(
    name: str,
    sources: Sequence[Path],
    *,
    include_dirs: Sequence[Path] = (),
    cflags: Sequence[str] = CFLAGS,
    ldflags: Sequence[str] = LDFLAGS,
    toolchain: Toolchain | None = None,
    root: Path | None = None,
) -> ModuleType:
    """The extension `name` built from `sources`, from the cache or compiled into
    it (`root`, default `cache_root()`, / `name-key`); raises when it cannot."""
    options = dict(include_dirs=include_dirs, cflags=cflags, ldflags=ldflags)
    key, ingredients = build_key(name, sources, toolchain=toolchain, **options)
    folder = (root or cache_root()) / f"{name}-{key}"
    module = _import_built(folder)
    if module is not None:
        return module
    with _build_lock(folder):
        module = _import_built(folder)  # built by the process this one waited for
        if module is not None:
            return module
        with contextlib.suppress(FileNotFoundError):  # torch's baton, left by a killed build
            (folder / "lock").unlink()
        log.info("servelab: compiling %s into %s (once per key)", name, folder)
        started = time.monotonic()
        module = _compile(f"{name}_{key}", sources, folder, include_dirs, cflags, ldflags)
        record = {
            "key": key,
            "module": module.__name__,
            "binary": Path(module.__file__).name,
            "build_seconds": round(time.monotonic() - started, 1),
            "ingredients": ingredients,
        }
        scratch = folder / f"{KEY_FILE}.tmp"
        scratch.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        os.replace(scratch, folder / KEY_FILE)
        return module


def build(name: str, source: str, *, what: str, fallback: str) -> ModuleType | None:
    """The extension `name` built from `csrc/<source>` (and the headers it
    includes), or None (logged): `what` names the kernel in the log,
    `fallback` says what runs instead."""
    if not kernels_enabled():
        log.info("servelab: %s=0, the %s is off; %s", SWITCH, what, fallback)
        return None
    try:
        return load_extension(name, [CSRC / source], include_dirs=[CSRC])
    except Exception as exc:  # no compiler, no headers, a sandbox: fall back
        log.warning("servelab: the %s could not be built (%s); %s", what, exc, fallback)
        return None
