"""Rejection sampling of drafts that carry their probabilities (Leviathan et al. 2023,
Chen et al. 2023): the verification of a sampled request whose proposer returned
`Draft.probs`.

The target's distributions p_0..p_k at a row's k + 1 positions are the sampler's
(`Sampler.last_probs`: after logits processing, grammar masks, temperature, top-k and
top-p, each over the tokens and drafts before it). Draft d_i, drawn from q_i, is kept
with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the row's token
is drawn from norm(max(0, p_i - q_i)) and the row ends there; with every draft kept,
the row's last token is the sampler's own draw from p_k. Each output token then
follows p exactly, whatever q is.

The tokens are written into the step's samples so that `servelab.step.verify`'s rule
(keep while a sample equals its draft) keeps exactly the accepted drafts and the
token after them: an accepted position holds its draft, and the draw at a rejection
never equals the rejected draft (its residual probability is 0: it was rejected, so
p(d) < q(d)).

Randomness: an unseeded row draws from the runner's generator. A seeded row's
uniform and residual noise are functions of (seed, output position, sample index),
salted apart from the sampler's own noise key and from any key a proposer derives
from the seed by its own salt: the same drafts give the same tokens in any batch.
"""

from __future__ import annotations

import torch

from servelab.model.sampler import noise_seed
from servelab.step.sequence import SamplingParams

# xor-ed into a seeded request's seed: its acceptance uniforms and its residual draws
# each get a noise stream of their own
ACCEPT_SALT = 0x5EC0_DACC
RESIDUAL_SALT = 0x5EC0_D7E5


def verify_by_rejection(
    probs: torch.Tensor,
    tokens: list[int],
    groups: list[tuple[int, list[int], torch.Tensor]],
    params: list[SamplingParams],
    positions: list[int],
    indices: list[int],
    sampler,
    generator: torch.Generator | None,
) -> None:
    """Rewrites `tokens` (one per sample row) in place for each group `(first sample
    row, drafts, q [len(drafts), vocab])`: rows first.. first + j - 1 hold the j
    accepted drafts, row first + j the token after them. `probs` [rows, vocab] are
    the target's distributions per sample row."""
    for first, drafts, q in groups:
        k = len(drafts)
        p = probs[first : first + k]
        q = q.to(device=p.device, dtype=p.dtype)
        index = torch.tensor(drafts, device=p.device)[:, None]
        p_d, q_d = p.gather(1, index)[:, 0], q.gather(1, index)[:, 0]
        uniforms = _uniforms(params[first], positions[first], indices[first], k, generator, p)
        accepted = (uniforms * q_d < p_d).tolist()  # u < p(d) / q(d), q(d) > 0
        j = accepted.index(False) if False in accepted else k
        tokens[first : first + j] = drafts[:j]
        if j == k:
            continue  # every draft kept: the sampler's draw from p_k follows them
        residual = (p[j] - q[j]).clamp_min_(0.0)
        residual[drafts[j]] = 0.0  # already 0 up to rounding: the draft was rejected
        if not residual.sum() > 0:  # p <= q everywhere but at rounding: p without the draft
            residual = p[j].clone()
            residual[drafts[j]] = 0.0
        noise = _exponential(params[first], positions[first] + j, indices[first], sampler,
                             generator, residual)  # fmt: skip
        tokens[first + j] = int((residual / noise.clamp_min_(1e-20)).argmax())


def _uniforms(
    params: SamplingParams,
    position: int,
    index: int,
    count: int,
    generator: torch.Generator | None,
    like: torch.Tensor,
) -> torch.Tensor:
    """`count` U(0, 1) draws, the i-th for output position `position + i`."""
    if params.seed is None:
        return torch.rand(count, generator=generator, device=like.device, dtype=like.dtype)
    draws = []
    for i in range(count):
        key = noise_seed(params.seed ^ ACCEPT_SALT, position + i, index)
        draws.append(torch.rand(1, generator=torch.Generator().manual_seed(key)))
    return torch.cat(draws).to(device=like.device, dtype=like.dtype)


def _exponential(
    params: SamplingParams,
    position: int,
    index: int,
    sampler,
    generator: torch.Generator | None,
    like: torch.Tensor,
) -> torch.Tensor:
    """Exp(1) noise over the vocabulary for the residual draw at `position`."""
    if params.seed is None:
        noise = torch.empty(like.shape, dtype=torch.float32, device=like.device)
        return noise.exponential_(generator=generator).to(like.dtype)
    key = noise_seed(params.seed ^ RESIDUAL_SALT, position, index)
    return sampler.seeded_exponential([key], like.shape[-1], like.device)[0].to(like.dtype)
