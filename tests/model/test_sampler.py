"""The batched sampler: greedy, top-k, top-p, temperature, per-request seeds.

Distributions are checked against a reference computed with plain Python math
(softmax of logits / T, then the top-k and nucleus cuts, renormalised) with a
chi-square statistic.
"""

from __future__ import annotations

import math

import pytest
import torch

from servelab.model.sampler import Sampler, counter_exponential, noise_seed
from servelab.step.sequence import SamplingParams

LOGITS_5 = [2.0, 1.0, 0.5, 0.0, -1.0]
# chi-square critical value, 4 degrees of freedom, p = 1e-4 (deterministic seeds anyway)
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51}


def reference_distribution(logits, temperature=1.0, top_k=-1, top_p=1.0) -> list[float]:
    exps = [math.exp(x / temperature) for x in logits]
    probs = [e / sum(exps) for e in exps]
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[i] for i in kept)
    nucleus, cumulative = [], 0.0
    for i in kept:  # smallest prefix whose renormalised mass reaches top_p
        nucleus.append(i)
        cumulative += probs[i] / mass
        if cumulative >= top_p:
            break
    total = sum(probs[i] for i in nucleus)
    return [probs[i] / total if i in nucleus else 0.0 for i in range(len(logits))]


def chi_square(counts: list[int], expected: list[float]) -> tuple[float, int]:
    n = sum(counts)
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected, strict=True) if p > 0)
    return stat, sum(p > 0 for p in expected) - 1


def draw_counts(params: SamplingParams, draws: int, seed: int = 0) -> list[int]:
    logits = torch.tensor([LOGITS_5] * draws, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    tokens = Sampler().sample(logits, [params] * draws, [0] * draws, gen)
    return torch.bincount(tokens, minlength=5).tolist()


def assert_matches(counts: list[int], expected: list[float]) -> None:
    for c, p in zip(counts, expected, strict=True):
        if p == 0:
            assert c == 0, f"a token outside the allowed set was drawn: {counts}"
    stat, dof = chi_square(counts, expected)
    assert stat < CHI2_CRIT[dof], f"chi2 {stat:.1f} for counts {counts} vs {expected}"


# -- greedy
def test_greedy_is_argmax_and_ties_go_to_lowest_index():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    logits[3, 7] = logits[3, 20] = logits[3].max() + 1  # a tie
    tokens = Sampler().sample(logits, [SamplingParams(temperature=0)] * 6, [0] * 6)
    assert tokens.tolist() == [int(row.argmax()) for row in logits]
    assert tokens[3] == 7


def test_greedy_rows_unaffected_by_sampled_rows():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.5, seed=3),
    ]
    tokens = Sampler().sample(logits, params, [0, 1, 2, 3], torch.Generator().manual_seed(2))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 100.0])
def test_top_k_1_equals_greedy(temperature):
    logits = torch.randn(16, 40, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=temperature, top_k=1)] * 16
    tokens = Sampler().sample(logits, params, list(range(16)), torch.Generator().manual_seed(4))
    assert torch.equal(tokens, logits.argmax(dim=-1))


# -- seeds: both ways of making seeded noise (the CPU's generator, the devices' counter hash)
NOISE = pytest.mark.parametrize("noise", ["generator", "counter"])


@NOISE
def test_seeded_row_ignores_the_rest_of_the_batch(noise):
    vocab = 64
    target_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    target = SamplingParams(temperature=1.0, seed=1234)

    def token_in_batch(batch_seed: int, others: int, row: int) -> int:
        gen = torch.Generator().manual_seed(batch_seed)
        logits = torch.randn(others + 1, vocab, generator=gen)
        logits[row] = target_logits
        params = [SamplingParams(temperature=1.3, top_p=0.9) for _ in range(others + 1)]
        params[row] = target
        positions = torch.randint(0, 50, (others + 1,), generator=gen).tolist()
        positions[row] = 17
        return int(Sampler(noise).sample(logits, params, positions, gen)[row])

    tokens = {
        token_in_batch(s, others, row)
        for s, others, row in [(0, 0, 0), (1, 5, 2), (2, 9, 9), (3, 3, 0)]
    }
    assert len(tokens) == 1


@NOISE
def test_seeded_rows_vary_with_position_seed_and_sample_index(noise):
    logits = torch.zeros(1, 1000)  # uniform: any fixed noise would show as repeats
    sampler = Sampler(noise)

    def draw(seed, position, index=0):
        params = [SamplingParams(temperature=1.0, seed=seed)]
        return int(sampler.sample(logits, params, [position], sample_indices=[index])[0])

    assert len({draw(7, p) for p in range(20)}) > 15
    assert len({draw(s, 3) for s in range(20)}) > 15
    assert len({draw(7, 3, i) for i in range(20)}) > 15
    assert draw(7, 3) == draw(7, 3)


@NOISE
def test_seeded_draws_follow_the_distribution(noise):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=99)
    draws = 5000
    logits = torch.tensor([LOGITS_5] * draws, dtype=torch.float64)
    # one request's successive output positions: each gets its own seeded noise
    tokens = Sampler(noise).sample(logits, [params] * draws, list(range(draws)))
    counts = torch.bincount(tokens, minlength=5).tolist()
    assert_matches(counts, reference_distribution(LOGITS_5, 1.0, -1, 0.95))


def test_counter_noise_row_depends_on_its_key_and_token_only():
    keys = [noise_seed(s, p) for s, p in [(1, 0), (1, 1), (2, 0)]]
    batch = counter_exponential(keys, 500, "cpu")
    assert torch.equal(batch[1:2], counter_exponential(keys[1:2], 500, "cpu"))
    # a token's noise does not depend on the vocabulary size either
    assert torch.equal(batch[:, :100], counter_exponential(keys, 100, "cpu"))
    assert not torch.equal(batch[0], batch[1])


def test_counter_noise_is_exponential():
    noise = counter_exponential([noise_seed(3, p) for p in range(4)], 50_000, "cpu").double()
    assert noise.min() > 0 and torch.isfinite(noise).all()
    assert abs(noise.mean() - 1) < 0.01 and abs(noise.var() - 1) < 0.03
    # exp(-E) is uniform: 10 equal bins, chi-square with 9 degrees of freedom, p = 1e-4
    counts = torch.histc(torch.exp(-noise), bins=10, min=0, max=1)
    expected = noise.numel() / 10
    assert float(((counts - expected) ** 2 / expected).sum()) < 33.7
    assert abs(float(torch.corrcoef(noise[:2])[0, 1])) < 0.02


# -- distributions
@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, -1, 1.0), (0.7, -1, 1.0), (2.0, -1, 1.0), (1.0, -1, 0.8), (0.7, 3, 1.0), (1.5, 4, 0.7)],
)
def test_distribution_matches_reference(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    counts = draw_counts(params, 20000)
    assert_matches(counts, reference_distribution(LOGITS_5, temperature, top_k, top_p))


def test_top_p_excludes_the_tail():
    # probabilities ~ [0.563, 0.207, 0.126, 0.076, 0.028]: p=0.75 keeps exactly the first two
    expected = reference_distribution(LOGITS_5, 1.0, -1, 0.75)
    assert [p > 0 for p in expected] == [True, True, False, False, False]
    counts = draw_counts(SamplingParams(temperature=1.0, top_p=0.75), 20000, seed=8)
    assert counts[2:] == [0, 0, 0] and min(counts[:2]) > 0


def test_tiny_top_p_keeps_the_best_token():
    counts = draw_counts(SamplingParams(temperature=1.0, top_p=1e-6), 2000, seed=9)
    assert counts == [2000, 0, 0, 0, 0]


def test_top_k_excludes_outside_k():
    vocab = 100
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(10)).repeat(5000, 1)
    tokens = Sampler().sample(
        logits,
        [SamplingParams(temperature=3.0, top_k=5)] * 5000,
        [0] * 5000,
        torch.Generator().manual_seed(11),
    )
    top5 = set(logits[0].topk(5).indices.tolist())
    assert set(tokens.tolist()) == top5


def test_bfloat16_logits_sample_valid_tokens():
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(12)).bfloat16()
    params = [SamplingParams(temperature=0.9, top_k=10, top_p=0.9)] * 4 + [
        SamplingParams(temperature=0)
    ] * 4
    tokens = Sampler().sample(logits, params, [0] * 8, torch.Generator().manual_seed(13))
    assert tokens.dtype == torch.int64 and tokens.shape == (8,)
    assert torch.equal(tokens[4:], logits[4:].argmax(dim=-1))
    top10 = logits[:4].float().topk(10, dim=-1).indices
    assert all(int(t) in row.tolist() for t, row in zip(tokens[:4], top10, strict=True))


# -- the device: noise is made where the logits are
class _Devices(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the device of every tensor an op returns with a vocabulary-sized dim."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.devices = vocab, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and self.vocab in t.shape:
                self.devices.add(t.device.type)
        return out


def test_no_vocabulary_sized_tensor_leaves_the_logits_device():
    # `meta` stands in for an accelerator: a tensor made on the CPU would show as `cpu`
    vocab = 97
    logits = torch.empty(4, vocab, device="meta")
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=1.2, top_p=0.8),
        SamplingParams(temperature=0.7, top_k=5, seed=2),
    ]
    recorder = _Devices(vocab)
    with recorder:
        tokens = Sampler().sample(logits, params, [0, 3, 1, 5], sample_indices=[0, 0, 0, 1])
    assert tokens.device.type == "meta" and tokens.shape == (4,)
    assert recorder.devices == {"meta"}


def test_a_generator_on_another_device_is_refused():
    logits = torch.empty(2, 10, device="meta")
    params = [SamplingParams(temperature=1.0)] * 2
    with pytest.raises(ValueError, match="generator is on cpu"):
        Sampler().sample(logits, params, [0, 0], torch.Generator(device="cpu"))


def test_top_k_past_the_vocabulary_keeps_every_token():
    """A top_k larger than any tensor index (2**70) samples as top_k off, and fails nothing."""
    import torch

    from servelab.model.sampler import Sampler
    from servelab.step.sequence import SamplingParams

    logits = torch.randn(2, 16, dtype=torch.float64)
    huge = SamplingParams(temperature=1.0, top_k=2**70, seed=5)
    off = SamplingParams(temperature=1.0, top_k=-1, seed=5)
    sampler = Sampler()
    assert sampler.sample(logits, [huge, off], [0, 0]).tolist() == sampler.sample(
        logits, [off, off], [0, 0]
    ).tolist()
