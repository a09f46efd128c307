"""docs/architecture.md lists the modules a request enters on the default CPU
path, from `LLM.generate` to its sampled token: trace a real request and hold
the page to it (every module entered is listed, every listed one is entered)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from servelab import LLM, SamplingParams

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
MAX_PATH_MODULES = 10


def documented() -> tuple[list[str], set[str]]:
    """The numbered path and the listed helpers of the page's request section."""
    section = DOC.read_text().split("## One request, module by module", 1)[1]
    path = re.findall(r"^\d+\. `(servelab[\w.]*)`", section, flags=re.M)
    helpers = {
        m
        for line in re.findall(r"^- (.*)$", section, flags=re.M)
        for m in re.findall(r"`(servelab[\w.]*)`", line)
    }
    return path, helpers


def modules_entered(llm: LLM, prompt: list[int]) -> list[str]:
    """servelab modules whose functions run during one `generate`, in first-entry order."""
    seen: dict[str, None] = {}

    def profile(frame, event, arg):
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("servelab"):
                seen.setdefault(module)

    sys.setprofile(profile)
    try:
        llm.generate([prompt], SamplingParams(max_tokens=1))
    finally:
        sys.setprofile(None)
    return list(seen)


def test_the_documented_request_path_is_the_real_one():
    llm = LLM()  # the defaults, as the page says
    llm.generate([[2, 3]], SamplingParams(max_tokens=1))  # first-call costs out of the trace
    entered = modules_entered(llm, [5, 6, 7, 8])
    path, helpers = documented()
    if not llm.engine.runner.cpu_kernels:  # no compiler here: the torch forward instead
        path = [
            m.replace("servelab.executor.kernel_forward", "servelab.model.transformer")
            for m in path
        ]
    assert 0 < len(path) <= MAX_PATH_MODULES
    assert set(entered) == set(path) | helpers, (
        f"entered but not listed: {sorted(set(entered) - set(path) - helpers)}; "
        f"listed but not entered: {sorted(set(path) | helpers - set(entered))}"
    )
    # the numbered modules appear in the order the request first enters them
    assert [m for m in entered if m in path] == path
