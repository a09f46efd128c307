"""The proposer contract: speculative decoding's guesses.

A proposer guesses the next tokens of running requests (drafts). The engine's
core verifies them in the next target forward: each request computes its last
token and its drafts in one row (causal within the drafts), samples at every
one of those positions exactly as it would without drafts, and keeps the
drafts up to the first one the target disagrees with, plus the target's own
token there. A proposer therefore changes how many forwards a request takes,
never what it outputs: greedy outputs are exactly those without a proposer,
and so are seeded sampled outputs (`servelab.step.verify`).

A proposer that samples its drafts (a draft model at the request's temperature)
may return their probabilities (`Draft.probs`). A sampled request's drafts are
then verified by rejection sampling (Leviathan et al. 2023; Chen et al. 2023:
keep draft d with probability min(1, p(d)/q(d)), else draw from
norm(max(0, p - q)) and stop; `servelab.model.rejection`): the output still
follows the target's distribution exactly, and more drafts are kept than with
point masses where p is spread out, but a seeded request's tokens then differ
from those without a proposer (they are still the same from run to run with
the same proposer). Greedy requests ignore `probs`.

What the core owns, so a proposer cannot get it wrong: the token budget (draft
tokens count against `max_num_batched_tokens`), the KV their verification
writes (allocated before the step, released for rejected tokens after it), the
cap at a request's remaining length, verification itself, and the knobs
every proposer takes (the base class's constructor options):
- `k`: the most drafts a request gets in one step;
- `adaptive_k`: a request's next cap follows its last verification (its
  accepted drafts plus one, at most `k`): later draft positions are accepted
  far less often than the first, so drafting on after a rejection mostly costs;
- `disable_above_batch_size`: no drafts while more requests decode than this
  (vLLM's `disable_by_batch_size`): a large batch is compute-bound, and
  verifying drafts there costs more than the forwards it saves;
- `disable_below_acceptance`: no drafts while the share of drafts the target
  kept, over the last `acceptance_window` drafts verified, is below this: a
  proposer that guesses wrong on this traffic only costs. Every
  `PROBE_EVERY`-th step drafts anyway, so the share is measured again and
  drafting resumes when the traffic changes.

A proposer never touches the allocator or the sequences: it sees a read-only
`DraftRequest` per request and returns token ids (a plain list, or a `Draft`).
It hears back how many drafts were accepted (`on_verified`) and when a request
leaves (`on_finish`), to keep per-request state.

Engine-supplied context: `vocab_size` (drafts must be ids below it) and
`engine_options` (dtype, device, seed, threads: what a proposer with a model
of its own loads it with).

What drafting costs is the executor's to measure or model: a real forward pays
for whatever the proposer runs; the simulated executor prices a draft model's
forwards from `draft_model()` (None: drafting costs nothing it sees).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence as ReadOnlyList
from dataclasses import dataclass
from typing import Any, ClassVar

from servelab.step.sequence import SamplingParams


class ProposerError(RuntimeError):
    """A proposer broke its contract (drafts of the wrong count or outside the vocabulary)."""


@dataclass(frozen=True)
class DraftRequest:
    """One running request as a proposer sees it, read-only."""

    seq_id: int  # the sequence (one of a request's n samples): drafts are per sequence
    request_id: str
    token_ids: ReadOnlyList[int]  # prompt and output so far; the last one is the newest sample
    num_prompt_tokens: int
    max_drafts: int  # return at most this many (k, the request's adaptive cap, its length left)
    # the request's sampling (temperature, top_k, top_p, seed): what a proposer that samples
    # its drafts samples with (never to be changed)
    params: SamplingParams | None = None
    sample_index: int = 0  # which of the request's n samples this sequence is (seeded noise)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]


@dataclass
class Draft:
    """A proposer's guess for one request: `tokens`, and optionally `probs`.

    Without `probs` each token is a single guess (a point mass): verification keeps
    it exactly when the target's own sample at its position equals it, which
    accepts with the probability rejection sampling gives (the target's
    probability of the token) and keeps the target's distribution.

    `probs` (a float tensor `[len(tokens), vocab_size]`, on any device): row i is the
    distribution q_i that `tokens[i]` was drawn from (given the tokens before it),
    each row summing to 1 and giving its token a probability above 0. A sampled
    request then verifies by rejection sampling (the module docstring)."""

    tokens: list[int]
    probs: Any = None


class Proposer(abc.ABC):
    """Guesses the next tokens of running requests; see the module docstring.

    A subclass implements `propose`; one with options of its own takes them as
    keyword arguments and passes the rest (`**common`) to this constructor.
    """

    description: ClassVar[str] = ""
    # False only for `none`: the core then never asks, and a step is exactly one
    # without speculative decoding
    proposes: ClassVar[bool] = True
    # True: the target's final hidden states reach `on_hidden_states` after each step
    # (a model-based proposer that reads them, as EAGLE's head does)
    needs_hidden_states: ClassVar[bool] = False

    def __init__(
        self,
        k: int = 4,
        adaptive_k: bool = False,
        disable_above_batch_size: int | None = None,
        disable_below_acceptance: float | None = None,
        acceptance_window: int = 256,
        vocab_size: int = 0,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be an integer >= 1 (the most drafts per step), got {k!r}")
        if disable_above_batch_size is not None and disable_above_batch_size < 1:
            raise ValueError(
                "disable_above_batch_size must be >= 1 or null (never disabled), "
                f"got {disable_above_batch_size!r}"
            )
        if disable_below_acceptance is not None and not 0.0 < disable_below_acceptance <= 1.0:
            raise ValueError(
                "disable_below_acceptance must be a share of kept drafts in (0, 1] or null "
                f"(never disabled), got {disable_below_acceptance!r}"
            )
        if not isinstance(acceptance_window, int) or acceptance_window < 1:
            raise ValueError(
                "acceptance_window must be an integer >= 1 (the drafts the kept share is "
                f"measured over), got {acceptance_window!r}"
            )
        self.k = k
        self.adaptive_k = adaptive_k
        self.disable_above_batch_size = disable_above_batch_size
        self.disable_below_acceptance = disable_below_acceptance
        self.acceptance_window = acceptance_window
        self.vocab_size = vocab_size
        self.engine_options = dict(engine_options or {})

    @abc.abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Draft | list[int] | None]:
        """Drafts for each request, in order: a list of token ids (at most its
        `max_drafts`; empty or None: no drafts this step) or a `Draft`."""

    def on_verified(self, seq_id: int, drafted: int, accepted: int) -> None:
        """The target accepted `accepted` of the `drafted` drafts of `seq_id`."""

    def on_hidden_states(self, seq_id: int, first: int, states: Any) -> None:
        """With `needs_hidden_states`: the target's final hidden states (after its
        final norm: what its LM head reads), `[count, hidden]`, of `seq_id`'s
        positions `first .. first + count - 1` computed in the last step, only
        positions whose K/V the target kept. A sequence computed again (after a
        recompute) sends positions from its start again."""

    def on_finish(self, seq_id: int) -> None:
        """`seq_id` left (finished, aborted or preempted): forget what it kept."""

    def draft_model(self) -> Any:
        """The model whose forwards make the drafts, for an executor that prices steps
        instead of running them: a model node as the `model` config takes it (a named
        shape such as "llama3-8b", a checkpoint folder, or `{name, path}`). The
        simulated executor adds to each step with drafts one decode step of this shape
        per draft position, over the rows drafting there, and its forward over the
        step's prompt chunks (a draft model keeps a KV cache of its own). None (the
        default): drafting costs nothing a cost model sees (a lookup, as `ngram`'s)."""
        return None
