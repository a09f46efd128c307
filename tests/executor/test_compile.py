"""`engine.compile=true`: torch.compile runs the model's torch ops, attention
stays eager (never traced) and is the only graph break, a parameter replaced
after fusing is still followed, and the tokens are the eager engine's."""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from servelab import LLM, SamplingParams
from servelab.engine.build import attention_backend
from servelab.executor.forward import TorchForward
from servelab.executor.kv_cache import KVCache
from servelab.model.loader import load_model
from servelab.step.metadata import AttentionMetadata

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS)]


def test_compile_keeps_attention_eager_and_the_tokens():
    compiled = LLM(model="tiny", dtype="float64", compile=True, max_model_len=64)
    forward = compiled.engine.executor.runner.model_forward
    assert isinstance(forward, TorchForward) and forward.compiled is not None
    assert not compiled.engine.executor.runner.cpu_kernels  # compile keeps the C++ kernels off
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


def test_compiled_forward_breaks_only_at_attention():
    """Dynamo splits the compiled forward at attention only (kept eager, once a
    layer): the fused projections' parameter check runs before the compiled call,
    so it does not break every projection out of the graph."""
    torch._dynamo.reset()
    counters.clear()
    llm = LLM(model="tiny", dtype="float64", compile=True, max_model_len=64)
    tokens(llm)
    reasons = list(counters["graph_break"])
    assert reasons, "the attention call must break the graph: the counter sees nothing"
    assert all("torch.compiler.disable" in reason for reason in reasons), reasons
    torch._dynamo.reset()


def test_compiled_forward_follows_a_replaced_parameter():
    """A projection's parameter replaced after fusing (q/k/v no longer views of
    one weight): the compiled forward must not use the stale fused weight."""
    model, _, _ = load_model("tiny", "float64", "cpu", seed=0)
    compiled, eager = TorchForward(model, compile=True), TorchForward(model)
    backend = attention_backend("per_request", model.config)
    ids, positions = torch.tensor([3, 9, 4, 1]), torch.arange(4)
    meta = AttentionMetadata.from_lists([4], [4], [[0]], 8)

    def run(forward):
        kv = KVCache(
            model.config.num_layers, 1, 8, model.config.num_kv_heads, model.config.head_dim,
            torch.float64, torch.device("cpu"),
        )  # fmt: skip
        with torch.inference_mode():
            return forward.forward(ids, positions, kv.layers, backend, backend.plan(meta))

    before = run(eager)
    torch.testing.assert_close(run(compiled), before, rtol=1e-12, atol=1e-12)
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(4)
    replaced = torch.randn(attn.q_proj.weight.shape, generator=gen, dtype=torch.float64)
    attn.q_proj.weight = torch.nn.Parameter(replaced * 0.1, requires_grad=False)
    assert not model.fused_current()  # the fused weight still holds the old q rows
    want = run(eager)  # separate matmuls: the new q weight
    assert (want - before).abs().max() > 1e-3
    torch.testing.assert_close(run(compiled), want, rtol=1e-12, atol=1e-12)
