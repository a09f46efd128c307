"""docs/architecture.md lists every servelab module one request enters on the
default CPU path, from `LLM.generate` to its sampled tokens (a prefill step
and decode steps), in the order it
first enters them: trace a real request with a profiler hook (every Python call
counted, no module left out) and hold the page, and the count, to it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from servelab import LLM, SamplingParams

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
# a module more on the path fails until a hop is removed
MAX_PATH_MODULES = 14


def documented() -> list[str]:
    """The numbered modules of the page's request section, in order."""
    section = DOC.read_text().split("## One request, module by module", 1)[1].split("\n## ")[0]
    return re.findall(r"^\d+\. `(servelab[\w.]*)`", section, flags=re.M)


def modules_entered(llm: LLM, prompt: list[int]) -> list[str]:
    """servelab modules whose Python functions run during one `generate`, in
    first-entry order (any module: a `servelab` name is all that is asked)."""
    # three tokens: the prefill step and two decode steps (built before the trace: the
    # call is all it sees)
    params = SamplingParams(max_tokens=3)
    seen: dict[str, None] = {}

    def profile(frame, event, arg):
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("servelab"):
                seen.setdefault(module)

    sys.setprofile(profile)
    try:
        llm.generate([prompt], params)
    finally:
        sys.setprofile(None)
    return list(seen)


def test_the_documented_request_path_is_the_real_one():
    llm = LLM()  # the defaults, as the page says
    llm.generate([[2, 3]], SamplingParams(max_tokens=1))  # first-call costs out of the trace
    entered = modules_entered(llm, [5, 6, 7, 8])
    listed = documented()
    path = listed
    if not llm.engine.executor.runner.cpu_kernels:  # no compiler here: the torch forward instead
        path = [
            m.replace("servelab.executor.kernel_forward", "servelab.model.transformer")
            for m in path
        ]
    assert entered[:2] == ["servelab.llm", "servelab.engine.engine"]
    assert entered == path, (
        f"entered but not listed: {sorted(set(entered) - set(path))}; "
        f"listed but not entered: {sorted(set(path) - set(entered))}; "
        f"entered, in order: {entered}"
    )
    assert len(entered) <= MAX_PATH_MODULES, f"{len(entered)} modules on the path: {entered}"
    assert f"runs code in these {len(listed)} modules" in " ".join(DOC.read_text().split())
