"""`check_proposer`: the kit passes the built-in proposers (and the testing
ones), and fails a proposer that breaks its contract with an AssertionError
naming the rule, although the core itself would only have dropped the broken
drafts (the run slower, its outputs still right)."""

from __future__ import annotations

import numpy as np
import pytest

from servelab.contracts.proposer import Draft, DraftRequest, Proposer
from servelab.plugins.proposers.ngram import NgramProposer
from servelab.plugins.proposers.none import NoProposer
from servelab.registry.plugin_manager import get_plugin_manager, registered
from servelab.testing import check_proposer
from servelab.testing.proposers import RepeatLastProposer


@pytest.mark.parametrize(
    "cls,options",
    [
        (NgramProposer, {}),
        (NgramProposer, {"k": 2, "min_n": 2, "max_n": 3, "adaptive_k": True}),
        (RepeatLastProposer, {"k": 6}),
    ],
    ids=["ngram", "ngram-adaptive", "repeat_last"],
)
def test_kit_passes_a_drafting_proposer(cls, options):
    report = check_proposer(cls, **options)
    assert report.kind == "proposer" and not report.skipped
    assert any("(aborts)" in c for c in report.combinations)
    assert "parallel sampling (n=2)" in report.properties
    assert report.draft_tokens > 0 and 0 <= report.accepted_tokens <= report.draft_tokens
    assert report.preempted > 0, "the kit's tight budget should preempt with drafts in flight"
    assert any("token_ids" in p for p in report.properties)


def test_kit_passes_none_without_asking_for_drafts():
    report = check_proposer(NoProposer)
    assert report.draft_tokens == 0
    assert any("never asks" in p for p in report.properties)


# -- deliberately broken proposers: each breaks one rule


class AppendsToTokens(RepeatLastProposer):
    """Appends its guess to the request's tokens: the sequence's own list."""

    def propose(self, requests):
        for request in requests:
            request.token_ids.append(request.last_token)
        return super().propose(requests)


class RewritesAToken(RepeatLastProposer):
    """Overwrites the first prompt token (same length: only a content check sees it)."""

    def propose(self, requests):
        for request in requests:
            request.token_ids[0] = (request.token_ids[0] + 1) % self.vocab_size
        return super().propose(requests)


class OneTooMany(Proposer):
    def propose(self, requests):
        return [Draft([r.last_token] * (r.max_drafts + 1)) for r in requests]


class OutOfVocabulary(Proposer):
    def propose(self, requests):
        return [[r.last_token, self.vocab_size] for r in requests]


class NumpyIds(Proposer):
    def propose(self, requests):
        return [list(np.asarray([r.last_token])) for r in requests]


class ReturnsAnArray(Proposer):
    def propose(self, requests):
        return [np.asarray([r.last_token]) for r in requests]


class SkipsTheFirst(Proposer):
    def propose(self, requests):
        return [[r.last_token] for r in requests[1:]]


class Raises(Proposer):
    def propose(self, requests):
        raise RuntimeError("the draft model is not loaded")


class ForgetsUnseen(RepeatLastProposer):
    """Keeps state only for the sequences it drafts its whole `k` for, and
    forgets every sequence that leaves as if it had state for it."""

    def __init__(self, **common) -> None:
        super().__init__(**common)
        self.full: dict[int, int] = {}

    def propose(self, requests):
        for r in requests:
            if r.max_drafts == self.k:
                self.full[r.seq_id] = len(r.token_ids)
        return super().propose(requests)

    def on_finish(self, seq_id):
        del self.full[seq_id]  # a KeyError for a sequence capped below k each time


class VerifiedRaises(RepeatLastProposer):
    def on_verified(self, seq_id, drafted, accepted):
        raise ValueError(f"{accepted} of {drafted}")


BROKEN = [
    (AppendsToTokens, r"propose changed DraftRequest.token_ids .* tokens became"),
    (RewritesAToken, r"propose changed DraftRequest.token_ids .* token at position 0 went from"),
    (OneTooMany, r"gave request .* drafts, more than its max_drafts=\d+"),
    (OutOfVocabulary, r"the draft token 128, outside the vocabulary: .*\[0, vocab_size=128\)"),
    (NumpyIds, r"the draft token np.int64\(\d+\), of type numpy.int64: token ids are Python ints"),
    (ReturnsAnArray, r"a ndarray; an entry is a list of token ids, a Draft or None"),
    (SkipsTheFirst, r"returned \d+ entries for \d+ requests; it must return one entry per request"),
    (Raises, r"propose raised RuntimeError: the draft model is not loaded"),
    (ForgetsUnseen, r"on_finish raised KeyError"),
    (VerifiedRaises, r"on_verified raised ValueError"),
]


@pytest.mark.parametrize("cls,message", BROKEN, ids=[c.__name__ for c, _ in BROKEN])
def test_kit_names_the_rule_a_proposer_breaks(cls, message):
    with pytest.raises(AssertionError, match=message) as caught:
        check_proposer(cls)
    text = str(caught.value)
    assert text.startswith("[continuous|paged,block_size=4|"), text  # the combination
    assert f"{cls.__module__}.{cls.__qualname__} breaks the proposer contract" in text


def test_kit_fails_a_proposer_that_never_drafts():
    class Shy(Proposer):
        def propose(self, requests: list[DraftRequest]):
            return [None] * len(requests)

    with pytest.raises(AssertionError, match=r"proposed no draft in any of the \d+ runs"):
        check_proposer(Shy)


def test_kit_names_the_contract_a_proposer_does_not_implement():
    class Abstract(Proposer):
        pass

    class NotAProposer:
        def propose(self, requests):
            return []

    with pytest.raises(AssertionError, match=r"not a valid proposer: .*does not implement propose"):
        check_proposer(Abstract)
    with pytest.raises(AssertionError, match=r"not a valid proposer: .*does not subclass"):
        check_proposer(NotAProposer)


def test_an_unknown_option_is_the_users_config_error():
    from servelab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"min_m"):
        check_proposer(NgramProposer, min_m=2)


def test_the_proposer_is_unregistered_after_a_failing_check():
    before = set(registered("proposer"))
    with pytest.raises(AssertionError):
        check_proposer(OneTooMany)
    assert set(registered("proposer")) == before
    assert not [n for n in get_plugin_manager().list_name_plugin() if "servelab.testing" in n[0]]
