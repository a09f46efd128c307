"""`LLM`: the facade. Parts are names or `{"name": ..., **options}` dicts;
engine options are keyword arguments.

    llm = LLM(model="tiny", scheduler="continuous", allocator="paged", dtype="float64")
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=16))
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from servelab.build import COMPONENT_DEFAULTS, build_engine
from servelab.engine import Engine
from servelab.sequence import RequestOutput, SamplingParams


class LLM:
    def __init__(
        self,
        model: str | dict = "tiny",
        scheduler: str | dict = COMPONENT_DEFAULTS["scheduler"],
        allocator: str | dict = COMPONENT_DEFAULTS["allocator"],
        preemption: str | dict = COMPONENT_DEFAULTS["preemption"],
        attention: str | dict = COMPONENT_DEFAULTS["attention"],
        **engine_options: Any,
    ) -> None:
        self.engine: Engine = build_engine(
            {
                "model": model,
                "scheduler": scheduler,
                "allocator": allocator,
                "preemption": preemption,
                "attention": attention,
                "engine": engine_options,
            }
        )

    def generate(
        self,
        prompts: Seq[str | list[int]] | str | list[int],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self.engine.generate(list(prompts), params)
