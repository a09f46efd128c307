"""`KernelForward` in float32 and bfloat16 against torch's float32 ops.

float32: the kernel path (oneDNN or servelab's matmul, whichever `cpu_matmul`
chose here) agrees with the torch path to float32 rounding. bfloat16: the
bfloat16 model through the kernel path (float32 activations, bfloat16 K/V)
gives logits within bfloat16 rounding of the float32 model holding the same
(bfloat16-representable) weights: a few units of 2^-8 of the logits' scale.
The torch path's bfloat16 logits are held to the same bound, so the bound is
the dtype's, not one fitted to the kernels.
"""

from __future__ import annotations

import pytest
import torch

from servelab.executor.forward import TorchForward, cpu_kernel_problems
from servelab.executor.kernel_forward import KernelForward
from servelab.model.loader import load_model
from servelab.plugins.attention.flash_varlen import FlashVarlenBackend
from tests.helpers_model import PagedDriver

BF16_EPS = 2.0**-8  # bfloat16's relative rounding step (8 significant bits)


def run_steps(model, forward, backend=None) -> torch.Tensor:
    """Logits of a two-prompt prefill step then two decode steps on a fresh cache."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (11, 5)]
    driver = PagedDriver(model, num_blocks=16, block_size=4, forward=forward, backend=backend)
    steps = [driver.step([(0, prompts[0]), (1, prompts[1])])]
    steps.append(driver.step([(0, [5]), (1, [7])]))
    steps.append(driver.step([(0, [9]), (1, [2])]))
    return torch.cat([t.float() for step in steps for t in step])


def models(shape: str):
    """The bfloat16 model and a float32 copy of exactly its weights."""
    low, _, _ = load_model(shape, "bfloat16", "cpu")
    high, _, _ = load_model(shape, "float32", "cpu")
    with torch.no_grad():
        for p_high, p_low in zip(high.parameters(), low.parameters(), strict=True):
            p_high.copy_(p_low.float())
    return low, high


@pytest.fixture(autouse=True)
def needs_the_kernels():
    model, _, _ = load_model("tiny", "float32", "cpu")
    if cpu_kernel_problems(model):
        pytest.skip(f"the C++ CPU kernels cannot run here: {cpu_kernel_problems(model)}")


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen2", "tiny-llama"])
def test_float32_kernel_path_matches_torch(shape):
    model, _, _ = load_model(shape, "float32", "cpu")
    with torch.no_grad():
        kernels = run_steps(model, KernelForward(model))
        reference = run_steps(model, TorchForward(model))
    torch.testing.assert_close(kernels, reference, rtol=1e-4, atol=1e-4)


def paged_kernel_backend(config) -> FlashVarlenBackend:
    """flash_varlen impl=cpu: its C++ paged kernel attends every step of `run_steps`
    (prompts shorter than the SDPA route's 16 tokens), in bfloat16 here."""
    return FlashVarlenBackend(
        config.num_heads, config.num_kv_heads, config.head_dim, config.attention_scale, impl="cpu"
    )


@pytest.mark.parametrize("attention", ["reference", "paged-kernel"])
@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen2", "tiny-llama"])
def test_bfloat16_logits_within_bfloat16_rounding_of_float32(shape, attention):
    low, high = models(shape)
    backend = paged_kernel_backend(low.config) if attention == "paged-kernel" else None
    with torch.no_grad():
        reference = run_steps(high, TorchForward(high))
        kernels = run_steps(low, KernelForward(low), backend)
        torch_bf16 = run_steps(low, TorchForward(low))
    if backend is not None:  # the bfloat16 paged kernel attended all 3 steps' layers
        assert backend.stats()["cpu_kernel_calls"] == 3 * low.config.num_layers
    bound = 8 * BF16_EPS * reference.abs().max().item()
    assert (torch_bf16 - reference).abs().max().item() <= bound  # the bound is bf16's
    assert (kernels - reference).abs().max().item() <= bound
    # the bound tells tokens apart: another position's logits lie far outside it
    assert (reference - reference.roll(1, 0)).abs().max().item() > 4 * bound


def test_bfloat16_kernel_path_writes_bfloat16_kv():
    low, _ = models("tiny")
    driver = PagedDriver(low, num_blocks=8, block_size=4, forward=KernelForward(low))
    with torch.no_grad():
        logits = driver.step([(0, [3, 4, 5])])
    assert driver.kv_caches[0][0].dtype == torch.bfloat16
    assert driver.kv_caches[0][0].abs().sum() > 0
    assert logits[0].dtype == torch.float32
