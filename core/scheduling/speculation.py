"""`Speculation`: the scheduler core's side of speculative decoding.

It asks the proposer for drafts once a step, for the sequences about to decode
(`draft`), checks what comes back against the contract, caps each sequence's
drafts (the proposer's `k`, the adaptive cap, the tokens the sequence may still
produce) and leaves them on `Sequence.draft_tokens`, where the core plans them
(a decode row of 1 + drafts tokens) and trims them to the step's budget. After
the forward it hears each verification (`verified`), counts it and tells the
proposer. The proposer sees each sequence through a read-only `DraftRequest`.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from servelab.contracts.proposer import Draft, DraftRequest, Proposer, ProposerError
from servelab.step.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)

# a proposer paused for low acceptance (`disable_below_acceptance`) still drafts every
# this many steps, so the kept share is measured again as the traffic changes
PROBE_EVERY = 16


class Speculation:
    """The drafts of one engine's steps, and their counts (vLLM's spec-decode metrics)."""

    def __init__(self, proposer: Proposer, max_model_len: int) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.k = proposer.k
        self.caps: dict[int, int] = {}  # seq_id -> its adaptive cap (adaptive_k)
        self.asked: dict[int, Sequence] = {}  # the sequences the proposer may keep state for
        # counts: verifications (a row with drafts), drafts offered, drafts accepted,
        # and accepted drafts by position (index 0: the first draft)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self.proposer_errors = 0  # steps whose proposal raised or broke the contract
        # `disable_below_acceptance`: the last verifications' (drafted, accepted), holding
        # at least `acceptance_window` drafts, their sums, and the steps paused
        self.window: deque[tuple[int, int]] = deque()
        self.window_drafted = self.window_accepted = 0
        self.paused_steps = 0
        self._low_for = 0  # steps in a row the kept share was below the floor
        self._logged: set[type] = set()  # error types logged already (once each)

    @property
    def active(self) -> bool:
        return self.proposer.proposes

    @property
    def wants_hidden(self) -> bool:
        return self.proposer.needs_hidden_states

    def draft(self, seqs: list[Sequence]) -> None:
        """Sets each sequence's `draft_tokens` for this step (sequences that are
        about to decode); no drafts above the proposer's batch-size limit."""
        self._forget_departed()
        for seq in seqs:
            seq.draft_tokens, seq.draft_probs = [], None
        limit = self.proposer.disable_above_batch_size
        if not seqs or (limit is not None and len(seqs) > limit) or self._paused():
            return
        asked, requests = [], []
        for seq in seqs:
            room = self._room(seq)
            if room > 0 and seq.params.speculative:
                asked.append(seq)
                self.asked[seq.seq_id] = seq
                requests.append(
                    DraftRequest(seq.seq_id, seq.request_id, seq.token_ids,
                                 seq.num_prompt_tokens, room, seq.params, seq.sample_index)
                )  # fmt: skip
        if not requests:
            return
        try:
            drafts = self._checked_drafts(requests)
        except Exception as exc:  # a proposer's bug costs its speed-up, never a request
            self._failed(exc)
            return
        for seq, (tokens, probs) in zip(asked, drafts):
            seq.draft_tokens, seq.draft_probs = tokens, probs

    def _checked_drafts(self, requests: list[DraftRequest]) -> list[tuple[list[int], Any]]:
        """The proposer's drafts for `requests`, each checked against the contract:
        (tokens, their probabilities or None)."""
        answers = self.proposer.propose(requests)
        if not isinstance(answers, (list, tuple)) or len(answers) != len(requests):
            raise ProposerError(
                f"{type(self.proposer).__name__}.propose returned {_describe(answers)} for "
                f"{len(requests)} requests; it must return one entry per request "
                "(a list of token ids, a Draft, or None)"
            )
        vocab = self.proposer.vocab_size
        drafts = []
        for request, answer in zip(requests, answers):
            tokens = list((answer.tokens if isinstance(answer, Draft) else answer) or ())
            if len(tokens) > request.max_drafts or not all(
                type(t) is int and 0 <= t < vocab for t in tokens
            ):
                raise ProposerError(
                    f"{type(self.proposer).__name__}.propose gave request "
                    f"{request.request_id!r} drafts {tokens[:8]!r}"
                    f"{'...' if len(tokens) > 8 else ''}; drafts must be at most "
                    f"max_drafts={request.max_drafts} integer token ids in [0, {vocab})"
                )
            probs = answer.probs if isinstance(answer, Draft) and tokens else None
            if probs is not None:
                _check_probs(self.proposer, request, tokens, probs, vocab)
            drafts.append((tokens, probs))
        return drafts

    def _room(self, seq: Sequence) -> int:
        """The most drafts `seq` may take: its cap, and one fewer than the tokens it
        may still produce (a verification adds its drafts plus the target's token)."""
        stop_at = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        return min(self.caps.get(seq.seq_id, self.k), stop_at - seq.num_tokens - 1)

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """`seq` had `drafted` drafts verified, `accepted` of them kept."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if self.proposer.disable_below_acceptance is not None:
            self._measure(drafted, accepted)
        for pos in range(min(accepted, self.k)):
            self.accepted_per_pos[pos] += 1
        if self.proposer.adaptive_k:
            self.caps[seq.seq_id] = min(self.k, accepted + 1)
        self._tell(self.proposer.on_verified, seq.seq_id, drafted, accepted)

    def _paused(self) -> bool:
        """Whether this step drafts nothing for low acceptance: the kept share of the
        last `acceptance_window` drafts is below `disable_below_acceptance` (every
        `PROBE_EVERY`-th such step drafts anyway, to measure again)."""
        floor = self.proposer.disable_below_acceptance
        low = (floor is not None and self.window_drafted >= self.proposer.acceptance_window
               and self.window_accepted < floor * self.window_drafted)  # fmt: skip
        self._low_for = self._low_for + 1 if low else 0
        if not low or self._low_for % PROBE_EVERY == 0:
            return False
        self.paused_steps += 1
        return True

    def _measure(self, drafted: int, accepted: int) -> None:
        """Adds a verification to the window, dropping the oldest while the rest
        still hold `acceptance_window` drafts."""
        self.window.append((drafted, accepted))
        self.window_drafted += drafted
        self.window_accepted += accepted
        size = self.proposer.acceptance_window
        while self.window and self.window_drafted - self.window[0][0] >= size:
            old_drafted, old_accepted = self.window.popleft()
            self.window_drafted -= old_drafted
            self.window_accepted -= old_accepted

    def _forget_departed(self) -> None:
        """Tells the proposer of the sequences it was asked for that left the running
        ones since (finished, aborted, preempted), whichever way they left."""
        departed = [s for s in self.asked.values() if s.status is not SequenceStatus.RUNNING]
        for seq in departed:
            del self.asked[seq.seq_id]
            self.caps.pop(seq.seq_id, None)
            self._tell(self.proposer.on_finish, seq.seq_id)

    def tell_hidden_states(self, seq_id: int, first: int, states) -> None:
        """Hands the proposer the target's hidden states (`on_hidden_states`)."""
        self._tell(self.proposer.on_hidden_states, seq_id, first, states)

    def _tell(self, hook, *args) -> None:
        """Calls one of the proposer's hooks: an error there costs drafts (the
        proposer's state may be off), never a request."""
        try:
            hook(*args)
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self.proposer_errors += 1
        if type(exc) not in self._logged:
            self._logged.add(type(exc))
            log.error("servelab: the proposer failed (%s: %s); requests go on, with fewer "
                      "drafts", type(exc).__name__, exc, exc_info=exc)  # fmt: skip

    def stats(self) -> dict[str, float]:
        """The counts, named as the run summary and the server's metrics take them."""
        out: dict[str, float] = {
            "spec_proposer_errors": self.proposer_errors,
            "spec_paused_steps": self.paused_steps,
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
        }
        for pos, count in enumerate(self.accepted_per_pos):
            out[f"spec_accepted_pos_{pos}"] = count
        return out


def _describe(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return f"{len(value)} entries"
    return f"a {type(value).__name__}"


def _check_probs(proposer: Proposer, request: DraftRequest, tokens: list[int], probs: Any,
                 vocab: int) -> None:  # fmt: skip
    """A `Draft.probs` that breaks the contract is the proposer's error (its shape,
    or a draft its own distribution gives no probability: rejection sampling divides
    by it). Torch-free: a tensor or numpy array (`shape`, fancy indexing, `tolist`)."""
    shape = tuple(getattr(probs, "shape", ()))
    if shape != (len(tokens), vocab):
        raise ProposerError(
            f"{type(proposer).__name__}.propose gave request {request.request_id!r} draft "
            f"probabilities of shape {shape}; they must be [drafts, vocab_size] = "
            f"[{len(tokens)}, {vocab}]"
        )
    # one gather (one device sync where the tensor is on a device), not one per draft
    own = probs[list(range(len(tokens))), list(tokens)].tolist()
    for i, (token, q) in enumerate(zip(tokens, own)):
        if not q > 0.0:
            raise ProposerError(
                f"{type(proposer).__name__}.propose gave request {request.request_id!r} draft "
                f"{token} at position {i} a draft probability of {q}; each draft's own "
                "probability must be above 0"
            )
