"""`KernelForward`: the model's forward through the C++ CPU kernels
(`servelab.executor.kernel_forward`) follows its parameters.

The program packs weights once; these tests change the parameters in every way
a user can (in place through a fused view, in place on a plain weight, a bias,
a whole parameter replaced, the tied embedding) and require the kernel path's
logits to equal the torch path's on the same model after each change, in
float64 (the agreement is to rounding: 1e-9, as against transformers in
`test_model.py`). A stale packed copy would differ at the first changed weight
by far more than that.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from servelab.executor.forward import TorchForward, choose_forward, cpu_kernel_problems
from servelab.executor.kernel_forward import KernelForward, PagedKernelAttention
from servelab.kernels import cpu_matmul
from servelab.model.loader import load_model
from tests.helpers_model import PagedDriver

TOL = 1e-9


@pytest.fixture(autouse=True)
def needs_the_kernels():
    model, _, _ = load_model("tiny", "float64", "cpu")
    if cpu_kernel_problems(model):
        pytest.skip(f"the C++ CPU kernels cannot run here: {cpu_kernel_problems(model)}")


def run_steps(model, forward) -> torch.Tensor:
    """Logits of a prompt step then a decode step on a fresh cache."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (9, 4)]
    driver = PagedDriver(model, num_blocks=16, block_size=4, forward=forward)
    first = driver.step([(0, prompts[0]), (1, prompts[1])])
    second = driver.step([(0, [5]), (1, [7])])
    return torch.cat(first + second)


def logits_both_ways(model, program) -> tuple[torch.Tensor, torch.Tensor]:
    """The same model's logits through its (long-lived) kernel program, then
    through torch's ops."""
    return run_steps(model, program), run_steps(model, TorchForward(model))


def assert_paths_agree(model, program) -> torch.Tensor:
    with torch.no_grad():
        kernels, reference = logits_both_ways(model, program)
    torch.testing.assert_close(kernels, reference, rtol=0, atol=TOL)
    return reference


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen2", "tiny-llama"])
def test_kernel_path_follows_every_parameter_change(shape):
    model, _, _ = load_model(shape, "float64", "cpu")
    program = KernelForward(model)  # once: the program must notice every change itself
    before = assert_paths_agree(model, program)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[1].mlp
    with torch.no_grad():
        attn.k_proj.weight.mul_(-1.5)  # a view of the fused q/k/v weight
        mlp.down_proj.weight.add_(0.01)  # a plain weight
        model.model.norm.weight.mul_(1.1)
        if attn.q_proj.bias is not None:
            attn.q_proj.bias.add_(0.5)  # Qwen2's q/k/v bias
        model.model.embed_tokens.weight.mul_(0.9)  # also the LM head when tied
    after = assert_paths_agree(model, program)
    assert (after - before).abs().max() > 1e-3  # the changes really changed the logits
    # a parameter replaced outright: q/k/v are no longer views of one tensor
    gen = torch.Generator().manual_seed(4)
    attn.q_proj.weight = nn.Parameter(
        torch.randn(attn.q_proj.weight.shape, generator=gen, dtype=torch.float64) * 0.1,
        requires_grad=False,
    )
    assert not attn.qkv.is_current()
    assert_paths_agree(model, program)


def test_the_forward_follows_engine_cpu_kernels():
    model, _, _ = load_model("tiny", "float64", "cpu")
    assert isinstance(choose_forward(model, "auto", compile=False), KernelForward)
    assert isinstance(choose_forward(model, "on", compile=False), KernelForward)
    assert isinstance(choose_forward(model, "off", compile=False), TorchForward)
    assert isinstance(choose_forward(model, "auto", compile=True), TorchForward)


@pytest.mark.parametrize("shape", ["tiny", "tiny-llama"])  # untied, tied
def test_logits_follow_the_head_weight_without_a_forward(shape):
    model, _, _ = load_model(shape, "float64", "cpu")
    program = KernelForward(model)
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    hidden = torch.randn(3, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(program.logits(hidden), hidden @ head.weight.T, rtol=0, atol=TOL)
        head.weight.mul_(-2.0)
        torch.testing.assert_close(program.logits(hidden), hidden @ head.weight.T, rtol=0, atol=TOL)


# -- the decoder loop (`cpu_decoder`): every layer in one C++ call


def paged_kernel_backend(model):
    """flash_varlen impl=cpu, its paged kernel selected, with its `forward`
    counted (the decoder loop must not call it)."""
    from servelab.plugins.attention.flash_varlen import FlashVarlenBackend

    config = model.config
    backend = FlashVarlenBackend(
        config.num_heads, config.num_kv_heads, config.head_dim, config.attention_scale, impl="cpu"
    )
    backend.check(SimpleNamespace(block_size=4, name="paged"), torch.device("cpu"), model.dtype)
    backend.forward_calls = 0
    forward = backend.forward

    def counted(*args):
        backend.forward_calls += 1
        return forward(*args)

    backend.forward = counted
    return backend


def drive(model, program, decoder: bool, steps) -> tuple[list[torch.Tensor], list, object]:
    """`steps` (each `PagedDriver.step`'s rows) on a fresh cache through the paged
    kernel's backend, with the decoder loop on or off; returns the logits, the K/V
    caches and the backend."""
    saved = program._decoder
    program._decoder = program._decoder if decoder else None
    try:
        driver = PagedDriver(model, num_blocks=32, block_size=4, forward=program)
        driver.backend = paged_kernel_backend(model)
        logits = [out for rows in steps for out in driver.step(rows)]
    finally:
        program._decoder = saved
    return logits, driver.kv_caches, driver.backend


def three_steps(model, program, decoder) -> tuple[list[torch.Tensor], list, object]:
    """A prompt step, a mixed step (a decode, a prompt's second chunk, a new
    prompt) and a decode-only step (`drive`)."""
    gen = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (11, 6, 7, 3)]
    steps = [
        [(0, tokens[0]), (1, tokens[1])],
        [(0, [4]), (1, tokens[2]), (2, tokens[3])],
        [(0, [9]), (1, [2]), (2, [8])],
    ]
    return drive(model, program, decoder, steps)


def assert_identical(fast, slow, fast_caches, slow_caches) -> None:
    """Equal logits and K/V caches, not close ones."""
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(fast_caches, slow_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def skip_without_the_decoder(program: KernelForward, dtype: str) -> None:
    """The one-call decoder runs on servelab's packed matmul only: skip, naming why,
    where this CPU sends `dtype` weights elsewhere (float32 without AVX-512 takes
    oneDNN) or the extension did not build."""
    path = cpu_matmul.path_for(getattr(torch, dtype))
    if path.name != "servelab":
        pytest.skip(f"{dtype} weights take the {path.name} matmul on this CPU ({path.why})")
    if program._decoder is None:
        pytest.skip("the decoder loop's extension cannot be built here")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen2", "tiny-llama"])
def test_decoder_loop_is_the_python_loop_bit_for_bit(shape, dtype):
    """The same kernels in the same order: equal logits and caches, not close ones
    (Qwen3's q/k norms, Qwen2's biases, Llama's neither: every optional weight)."""
    model, _, _ = load_model(shape, dtype, "cpu")
    program = KernelForward(model)
    skip_without_the_decoder(program, dtype)
    fast, fast_caches, fast_backend = three_steps(model, program, decoder=True)
    slow, slow_caches, slow_backend = three_steps(model, program, decoder=False)
    assert fast_backend.forward_calls == 0  # every step went through the C++ loop
    assert slow_backend.forward_calls == 3 * model.config.num_layers
    # both account every layer the paged kernel attended
    assert (
        fast_backend.stats()
        == slow_backend.stats()
        == {"cpu_kernel_calls": 3 * model.config.num_layers, "cpu_prompt_kernel_calls": 0}
    )
    assert_identical(fast, slow, fast_caches, slow_caches)


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen2", "tiny-llama"])
def test_bf16_decoder_loop_is_the_python_loop_bit_for_bit_at_one_token(shape):
    """bfloat16 weights on the bf16 row kernel: a one-token step runs every layer in
    one C++ call, with the Python loop's logits and caches exactly; a step of more
    tokens (the prompt) keeps the Python loop on oneDNN."""
    model, _, _ = load_model(shape, "bfloat16", "cpu")
    program = KernelForward(model)
    if program._decoder is None:
        path = cpu_matmul.path_for(torch.bfloat16)
        pytest.skip(f"no bf16 row kernel here: bf16 weights take {path.name} ({path.why}), "
                    "or the CPU has no AVX512-BF16")  # fmt: skip

    # a prompt, then five one-token steps crossing a block boundary
    steps = [[(0, [3, 1, 4, 1, 5, 9, 2])]] + [[(0, [token])] for token in (6, 5, 3, 5, 8)]
    fast, fast_caches, fast_backend = drive(model, program, True, steps)
    slow, slow_caches, slow_backend = drive(model, program, False, steps)
    layers = model.config.num_layers
    assert fast_backend.forward_calls == layers  # the prompt step alone
    assert slow_backend.forward_calls == 6 * layers
    # the 7-token prompt is below SDPA_PROMPT_TOKENS: its tokens take the decode kernel
    want = {"cpu_kernel_calls": 6 * layers, "cpu_prompt_kernel_calls": 0}
    assert fast_backend.stats() == slow_backend.stats() == want
    assert fast[0].dtype == torch.float32 and fast_caches[0][0].dtype == torch.bfloat16
    assert_identical(fast, slow, fast_caches, slow_caches)


def test_decoder_loop_only_where_the_backend_says_so():
    """A backend that is no `PagedKernelAttention` keeps its own `forward` in
    every layer."""
    model, _, _ = load_model("tiny", "float64", "cpu")
    program = KernelForward(model)
    driver = PagedDriver(model, num_blocks=16, block_size=4, forward=program)  # dense reference
    assert not isinstance(driver.backend, PagedKernelAttention)
    calls = []
    forward = driver.backend.forward
    driver.backend.forward = lambda *args: calls.append(1) or forward(*args)
    driver.step([(0, [1, 2, 3])])
    assert len(calls) == model.config.num_layers


def test_decoder_loop_rejects_a_token_outside_the_vocabulary():
    model, _, _ = load_model("tiny", "float64", "cpu")  # float64: servelab's matmul on every CPU
    program = KernelForward(model)
    skip_without_the_decoder(program, "float64")
    driver = PagedDriver(model, num_blocks=16, block_size=4, forward=program)
    driver.backend = paged_kernel_backend(model)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        driver.step([(0, [1, model.config.vocab_size])])
