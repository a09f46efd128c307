"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds;
`sample_isolating_rows` (at the end) finds the rows whose own sampling raises.

Rules:
- greedy rows (temperature 0 or top_k 1): raw logits' `argmax` (own dtype, lowest index on ties);
- other rows: logits / temperature, top-k, top-p (the smallest set of best tokens whose mass
  reaches p; the best is always kept), softmax, then the exponential race `argmax(probs / E)`,
  E ~ Exp(1) i.i.d. per token, which picks token i with probability probs[i];
- a seeded request's E is a pure function of (seed, output position, sample index), made on
  the logits' device: the same tokens in any batch and after preemption and recompute. On
  the CPU a generator seeded by their hash draws each row; elsewhere (`seeded_noise=counter`)
  E is counter-based, a hash of (key, token id) in torch ops, one batched pass for all seeded
  rows instead of a launch per row. Unseeded rows draw from `generator`, which must be on
  the logits' device (torch's default where None), in one batched call;
- no [N, V] tensor is built on another device than the logits' (no per-step upload);
- rows with logits processing (penalties, min_tokens, logit_bias:
  `servelab.model.logits_processing`) have it applied first, then a constrained row's
  grammar mask (structured outputs: `servelab.model.grammar`); both rules then read the
  processed logits.
"""

from __future__ import annotations

import time

import torch

from servelab.model.grammar import apply_grammar_masks
from servelab.model.logits_processing import process_logits
from servelab.step.sequence import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A 64-bit mixing function: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, output_position: int, sample_index: int = 0) -> int:
    """The noise key of one seeded row: a 64-bit hash of all three numbers."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (output_position & _MASK64))
    return _splitmix64(h ^ (sample_index & _MASK64))


_MASK32 = (1 << 32) - 1
# two odd multipliers below 2**31 (a lowbias32-style mixer): a 32-bit value times one stays
# below 2**63, so every product is exact in int64 on every device, no overflow relied on
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash of int64 tensors holding values in [0, 2**32), in place."""
    x ^= x >> 16
    x.mul_(_MUL1).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_MUL2).bitwise_and_(_MASK32)
    x ^= x >> 15
    return x


def counter_exponential(keys: list[int], vocab_size: int, device) -> torch.Tensor:
    """Exp(1) noise [len(keys), vocab_size] float32 on `device`: row r, token j is a hash of
    (keys[r], j) only, the same on every device and in any batch."""
    halves = torch.tensor([[k & _MASK32, k >> 32] for k in keys], device=device)
    x = torch.arange(vocab_size, device=device).expand(len(keys), -1) ^ halves[:, :1]
    x = _mix32(_mix32(x) ^ halves[:, 1:])
    # 32 bits to a uniform in (0, 1) at bin midpoints (never 0 or 1, so E is finite and > 0)
    uniform = (x.to(torch.float64) + 0.5) * 2.0**-32
    return uniform.log_().neg_().to(torch.float32)


def generator_exponential(keys: list[int], vocab_size: int, device) -> torch.Tensor:
    """Exp(1) noise [len(keys), vocab_size] float32: row r from a generator on `device`
    seeded with keys[r] (one draw per row; the CPU's way, cheaper there than the hash)."""
    noise = torch.empty(len(keys), vocab_size, dtype=torch.float32, device=device)
    generator = torch.Generator(device=device)
    for row, key in zip(noise, keys, strict=True):
        row.exponential_(generator=generator.manual_seed(key))
    return noise


SEEDED_NOISE = {"counter": counter_exponential, "generator": generator_exponential}


class Sampler:
    """Turns the LM head's rows into tokens, one row per sampling sequence.
    `seeded_noise`: how seeded rows' noise is made, `auto` (generator on the CPU, counter
    elsewhere), `counter` or `generator`."""

    def __init__(self, seeded_noise: str = "auto") -> None:
        if seeded_noise not in ("auto", *SEEDED_NOISE):
            raise ValueError(f"seeded_noise={seeded_noise!r}: one of auto, counter, generator")
        self.seeded_noise = seeded_noise
        # structured outputs: the last call's masked rows and the seconds their masks took
        self.masked_rows = 0
        self.mask_seconds = 0.0
        # with keep_probs set, each call keeps the distributions its sampled rows drew from
        # ([N, V], greedy rows' unused) in last_probs (rejection sampling reads them), or None
        # when every row was greedy
        self.keep_probs = False
        self.last_probs: torch.Tensor | None = None

    def seeded_exponential(self, keys: list[int], vocab_size: int, device) -> torch.Tensor:
        """Seeded rows' Exp(1) noise [len(keys), vocab_size] float32 on `device`."""
        kind = self.seeded_noise
        if kind == "auto":
            kind = "generator" if torch.device(device).type == "cpu" else "counter"
        return SEEDED_NOISE[kind](keys, vocab_size, device)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_positions: list[int],
        generator: torch.Generator | None = None,
        sample_indices: list[int] | None = None,
        seqs: list | None = None,
        logits_writable: bool = False,
    ) -> torch.Tensor:
        """logits [N, V]; `output_positions[i]` is how many tokens row i's sequence
        has generated so far (the index of the token being drawn); `sample_indices`
        tells the n samples of one seeded request apart (default 0); `seqs[i]` is row
        i's sequence (needed only when a row's params process logits);
        `logits_writable`: the caller reads `logits` no more, so a grammar mask may
        be applied to it in place (otherwise to a copy).
        Returns LongTensor [N] on the logits' device."""
        num_rows, vocab_size = logits.shape
        if any(p.processes_logits for p in params):
            if seqs is None:
                raise ValueError("logits processing (penalties, min_tokens, logit_bias) needs "
                                 "each row's sequence: pass seqs")  # fmt: skip
            adjusted = any(p.adjusts_logits for p in params)
            if adjusted:
                logits = process_logits(logits, params, seqs)  # a copy: masks may go in place
            start = time.perf_counter()  # the masks' cost (with the copy they alone need)
            if not adjusted and not logits_writable:
                logits = logits.clone()
            self.masked_rows = apply_grammar_masks(logits, seqs)
            self.mask_seconds = time.perf_counter() - start if self.masked_rows else 0.0
        else:
            self.masked_rows, self.mask_seconds = 0, 0.0
        self.last_probs = None
        greedy_tokens = logits.argmax(dim=-1)
        greedy = [p.greedy for p in params]
        if all(greedy):
            return greedy_tokens
        device = logits.device
        work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32

        # -- per-row parameters as tensors (greedy rows get neutral values)
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_ks = [  # a top_k past the vocabulary keeps every token
            min(p.top_k, vocab_size) if p.top_k > 0 and not g else vocab_size
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
        if self.keep_probs:
            self.last_probs = probs

        noise = self._race_noise(
            num_rows, vocab_size, params, output_positions, sample_indices, generator, device
        )
        # the exponential race; a tiny floor keeps 0 noise from producing inf / nan
        sampled = (probs / noise.to(work_dtype).clamp_min_(1e-20)).argmax(dim=-1)
        return torch.where(torch.tensor(greedy, device=device), greedy_tokens, sampled)

    def _race_noise(
        self,
        num_rows: int,
        vocab_size: int,
        params: list[SamplingParams],
        output_positions: list[int],
        sample_indices: list[int] | None,
        generator: torch.Generator | None,
        device: torch.device,
    ) -> torch.Tensor:
        """Exp(1) noise [N, V] float32 on `device`: unseeded sampled rows from `generator` in one
        batched draw, seeded rows from their keys; greedy rows' noise is unused (ones)."""
        if generator is not None and not _same_device(generator.device, device):
            raise ValueError(
                f"the sampling generator is on {generator.device}, the logits on {device}: "
                "noise is drawn where the logits are (make the generator on that device)"
            )
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        seeded_rows = [i for i in sampled if params[i].seed is not None]
        if len(seeded_rows) < len(sampled):
            noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
            noise.exponential_(generator=generator)
        else:
            noise = torch.ones(num_rows, vocab_size, dtype=torch.float32, device=device)
        if seeded_rows:
            keys = [
                noise_seed(
                    params[i].seed,
                    output_positions[i],
                    sample_indices[i] if sample_indices is not None else 0,
                )
                for i in seeded_rows
            ]
            seeded = self.seeded_exponential(keys, vocab_size, device)
            if len(seeded_rows) == num_rows:
                return seeded
            noise[torch.tensor(seeded_rows, device=device)] = seeded
        return noise


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


def _same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` name one device when the current one is 0."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" else 0
        return (a.index if a.index is not None else current) == (
            b.index if b.index is not None else current
        )
    return a.index == b.index


# -- one request's sampling error fails that request only
# The sampler draws every row in one batched call. When that call raises, each row is
# sampled alone to find the rows that raise by themselves; those rows are reported as
# failed and the batch is sampled again with them made plain greedy (a stand-in token
# the engine drops with the request). Every other row then gets exactly the token the
# unfailed batch would have given it: rows are computed independently, seeded rows'
# noise depends on their seed and position only, and the generator's state is put
# back before the retry, so unseeded rows draw the very noise they would have drawn.
# When no row raises alone, the error belongs to the batch, not to a request: it is
# raised again and the engine fails the step as before. The state is saved before
# each batched call (a few microseconds); nothing else is added to a step that works.

STAND_IN = SamplingParams(temperature=0.0)  # a failed row's params in the retry


def sample_isolating_rows(
    sampler,
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    generator: torch.Generator | None,
    indices: list[int],
    seqs: list | None,
    logits_writable: bool = False,
) -> tuple[list[int], dict[int, Exception]]:
    """Tokens, one per row of `logits`, and {row: its error} for the rows whose
    sampling raised (their tokens are stand-ins). Raises the batch's error when
    no row raises alone. `logits_writable`: see `Sampler.sample` (a grammar mask
    applied twice is the same mask, so the retries may see it applied)."""
    rng = _generator_of(generator, logits.device)
    state = rng.get_state() if rng is not None else None
    try:
        return sampler.sample(logits, params, positions, generator, indices, seqs,
                              logits_writable).tolist(), {}  # fmt: skip
    except Exception as exc:
        batch_error = exc
    failed: dict[int, Exception] = {}
    for row in range(len(params)):
        try:
            sampler.sample(logits[row : row + 1], [params[row]], [positions[row]], generator,
                           [indices[row]], None if seqs is None else [seqs[row]],
                           logits_writable)  # fmt: skip
        except Exception as exc:
            failed[row] = exc
    if not failed:
        raise batch_error
    if rng is not None:
        rng.set_state(state)
    kept = [STAND_IN if row in failed else p for row, p in enumerate(params)]
    tokens = sampler.sample(logits, kept, positions, generator, indices, seqs,
                            logits_writable).tolist()  # fmt: skip
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
