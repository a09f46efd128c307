"""One step's sampling, where an error in one request's rows fails that request only.

The sampler draws every row in one batched call. When that call raises, each row is
sampled alone to find the rows that raise by themselves; those rows are reported as
failed and the batch is sampled again with them made plain greedy (a stand-in token
the engine drops with the request). Every other row then gets exactly the token the
unfailed batch would have given it: rows are computed independently, seeded rows'
noise depends on their seed and position only, and the generator's state is put
back before the retry, so unseeded rows draw the very noise they would have drawn.
When no row raises alone, the error belongs to the batch, not to a request: it is
raised again and the engine fails the step as before. The state is saved before
each batched call (a few microseconds); nothing else is added to a step that works.
"""

from __future__ import annotations

import torch

from servelab.step.sequence import SamplingParams

STAND_IN = SamplingParams(temperature=0.0)  # a failed row's params in the retry


def sample_isolating_rows(
    sampler,
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    generator: torch.Generator | None,
    indices: list[int],
    seqs: list | None,
) -> tuple[list[int], dict[int, Exception]]:
    """Tokens, one per row of `logits`, and {row: its error} for the rows whose
    sampling raised (their tokens are stand-ins). Raises the batch's error when
    no row raises alone."""
    rng = _generator_of(generator, logits.device)
    state = rng.get_state() if rng is not None else None
    try:
        return sampler.sample(logits, params, positions, generator, indices, seqs).tolist(), {}
    except Exception as exc:
        batch_error = exc
    failed: dict[int, Exception] = {}
    for row in range(len(params)):
        try:
            sampler.sample(logits[row : row + 1], [params[row]], [positions[row]], generator,
                           [indices[row]], None if seqs is None else [seqs[row]])  # fmt: skip
        except Exception as exc:
            failed[row] = exc
    if not failed:
        raise batch_error
    if rng is not None:
        rng.set_state(state)
    kept = [STAND_IN if row in failed else p for row, p in enumerate(params)]
    tokens = sampler.sample(logits, kept, positions, generator, indices, seqs).tolist()
    return tokens, failed


def _generator_of(generator: torch.Generator | None, device: torch.device):
    """The generator unseeded rows draw from: the given one, else the device's default."""
    if generator is not None:
        return generator
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None  # another device: its unseeded rows may draw other noise in the retry
