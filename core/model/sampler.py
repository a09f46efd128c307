"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Rules:
- greedy rows (temperature 0 or top_k 1): raw logits' `argmax` (own dtype, lowest index on ties);
- other rows: logits / temperature, top-k, top-p (the smallest set of best tokens whose mass
  reaches p; the best is always kept), softmax, then the exponential race `argmax(probs / E)`,
  E ~ Exp(1) i.i.d. per token, which picks token i with probability probs[i];
- a seeded request's E comes from a CPU generator seeded by (seed, output position, sample
  index) only: the same tokens in any batch and after preemption and recompute; unseeded
  rows draw from `generator` (or torch's default) in one batched call.
"""

from __future__ import annotations

import torch

from servelab.step.sequence import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A 64-bit mixing function: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, output_position: int, sample_index: int = 0) -> int:
    """The generator seed for one seeded row: a hash of all three numbers."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (output_position & _MASK64))
    return _splitmix64(h ^ (sample_index & _MASK64))


def seeded_exponential(seed: int, output_position: int, vocab_size: int, sample_index: int = 0):
    """Exp(1) noise [vocab_size], float32 on the CPU, a pure function of its arguments."""
    generator = torch.Generator(device="cpu").manual_seed(
        noise_seed(seed, output_position, sample_index)
    )
    return torch.empty(vocab_size, dtype=torch.float32).exponential_(generator=generator)


class Sampler:
    """Turns the LM head's rows into tokens, one row per sampling sequence."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_positions: list[int],
        generator: torch.Generator | None = None,
        sample_indices: list[int] | None = None,
    ) -> torch.Tensor:
        """logits [N, V]; `output_positions[i]` is how many tokens row i's sequence
        has generated so far (the index of the token being drawn); `sample_indices`
        tells the n samples of one seeded request apart (default 0).
        Returns LongTensor [N] on the logits' device."""
        num_rows, vocab_size = logits.shape
        greedy_tokens = logits.argmax(dim=-1)
        greedy = [p.greedy for p in params]
        if all(greedy):
            return greedy_tokens
        device = logits.device
        work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32

        # -- per-row parameters as tensors (greedy rows get neutral values)
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_ks = [
            p.top_k if p.top_k > 0 and not g else vocab_size
            for p, g in zip(params, greedy, strict=True)
        ]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        scaled = (
            logits.to(work_dtype)
            / torch.tensor(temperatures, dtype=work_dtype, device=device)[:, None]
        )

        if any(k < vocab_size for k in top_ks) or any(p < 1.0 for p in top_ps):
            scaled = _apply_top_k_top_p(
                scaled,
                torch.tensor(top_ks, device=device),
                torch.tensor(top_ps, dtype=work_dtype, device=device),
            )
        probs = scaled.softmax(dim=-1)

        noise = _race_noise(
            num_rows, vocab_size, params, output_positions, sample_indices, generator, device
        )
        # the exponential race; a tiny floor keeps 0 noise from producing inf / nan
        sampled = (probs / noise.to(work_dtype).clamp_min_(1e-20)).argmax(dim=-1)
        return torch.where(torch.tensor(greedy, device=device), greedy_tokens, sampled)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k, then outside its top-p nucleus.
    One stable descending sort serves both; ties keep the lower index first."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # keep a token while the better ones have not reached p yet (the best has 0 before it)
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _race_noise(
    num_rows: int,
    vocab_size: int,
    params: list[SamplingParams],
    output_positions: list[int],
    sample_indices: list[int] | None,
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """Exp(1) noise [N, V] float32: one batched draw, then seeded rows overwritten."""
    noise_device = generator.device if generator is not None else device
    noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=noise_device)
    noise.exponential_(generator=generator)
    noise = noise.to(device)
    seeded_rows = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
    if seeded_rows:
        rows = [
            seeded_exponential(
                params[i].seed,
                output_positions[i],
                vocab_size,
                sample_indices[i] if sample_indices is not None else 0,
            )
            for i in seeded_rows
        ]
        noise[torch.tensor(seeded_rows, device=device)] = torch.stack(rows).to(device)
    return noise
