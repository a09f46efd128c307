"""`LLM`: the facade. Parts are names or `{"name": ..., **options}` dicts;
engine options are keyword arguments; `executor="simulated", hardware="h100-sxm"`
runs the same parts against a cost model.

    llm = LLM(model="tiny", scheduler="continuous", allocator="paged", dtype="float64")
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=16))
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, cast

from servelab.contracts.kinds import KINDS
from servelab.engine.build import build_engine
from servelab.engine.engine import Engine
from servelab.engine.loop import EngineLoop
from servelab.step.sequence import RequestOutput, SamplingParams

CUDA_DTYPE = "bfloat16"  # what conf/device/cuda.yaml sets: tensor-core dots, half the KV bytes


def with_device_dtype(engine_options: dict[str, Any]) -> dict[str, Any]:
    """The options with `dtype` defaulting to bfloat16 on a CUDA device (float32 elsewhere)."""
    on_cuda = str(engine_options.get("device", "cpu")).startswith("cuda")
    if on_cuda and "dtype" not in engine_options:
        return {**engine_options, "dtype": CUDA_DTYPE}
    return engine_options


class LLM:
    def __init__(
        self,
        model: str | dict = "tiny",
        scheduler: str | dict = KINDS["scheduler"].default,
        allocator: str | dict = KINDS["allocator"].default,
        preemption: str | dict = KINDS["preemption"].default,
        attention: str | dict = KINDS["attention"].default,
        executor: str | dict = KINDS["executor"].default,
        hardware: str | dict | None = None,
        **engine_options: Any,
    ) -> None:
        self.engine: Engine = build_engine(
            {
                "model": model,
                "scheduler": scheduler,
                "allocator": allocator,
                "preemption": preemption,
                "attention": attention,
                "executor": executor,
                "hardware": hardware,
                "engine": with_device_dtype(engine_options),
            }
        )
        # the engine's one loop: `generate` and a server on this engine submit through it
        self.loop = EngineLoop(self.engine)

    def generate(
        self,
        prompts: Seq[str | list[int]] | str | list[int],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast("str | list[int]", prompts)]
        else:
            batch = list(cast("Seq[str | list[int]]", prompts))
        return self.loop.generate(batch, params)
