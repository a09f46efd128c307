"""`engine.compile=true`: torch.compile runs the model's torch ops, attention
stays eager (never traced), and the tokens are the eager engine's."""

from __future__ import annotations

import torch

from servelab import LLM, SamplingParams
from servelab.executor.forward import TorchForward

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS)]


def test_compile_keeps_attention_eager_and_the_tokens():
    compiled = LLM(model="tiny", dtype="float64", compile=True, max_model_len=64)
    forward = compiled.engine.runner.model_forward
    assert isinstance(forward, TorchForward) and forward.compiled is not None
    assert not compiled.engine.runner.cpu_kernels  # compile keeps the C++ kernels off
    traced = []
    backend = compiled.engine.backend
    attend = backend.forward

    def spy(*args):
        traced.append(torch.compiler.is_compiling())
        return attend(*args)

    backend.forward = spy
    got = tokens(compiled)
    assert traced and not any(traced)  # every layer's attention ran, none of it traced
    eager = LLM(model="tiny", dtype="float64", cpu_kernels="off", max_model_len=64)
    assert got == tokens(eager)
