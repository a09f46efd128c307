"""Proposers for testing speculative decoding: they draft what the target will
really say, often enough that verification keeps long runs (to the end of a
request, past a stop token, over a block boundary), and wrong at random
positions, so every rejection point is exercised too.

`ReferenceProposer` drafts from known outputs: for a sequence whose prompt is
one of `prompts`, the continuation of `outputs[i]` after the tokens it has
produced, each draft replaced by a wrong token with probability `wrong`
(seeded); past the known output, or once the sequence left it, random tokens.
"""

from __future__ import annotations

import random
from typing import Any

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.proposer import DraftRequest, Proposer


class ReferenceProposer(Proposer):
    description = "drafts from known outputs, wrong at random positions (testing)"

    def __init__(
        self,
        prompts: Any = (),
        outputs: Any = (),
        wrong: float = 0.25,
        seed: int = 0,
        **common,
    ) -> None:
        super().__init__(**common)
        self.answers = {tuple(p): list(o) for p, o in zip(prompts, outputs)}
        self.wrong = wrong
        self.rng = random.Random(seed)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [self._draft(r) for r in requests]

    def _draft(self, request: DraftRequest) -> list[int]:
        tokens = request.token_ids
        answer = self.answers.get(tuple(tokens[: request.num_prompt_tokens]), [])
        produced = list(tokens[request.num_prompt_tokens :])
        ahead = answer[len(produced) :] if answer[: len(produced)] == produced else []
        count = self.rng.randint(1, request.max_drafts)
        drafts = []
        for i in range(count):
            right = ahead[i] if i < len(ahead) else None
            if right is None or self.rng.random() < self.wrong:
                drafts.append(self.rng.randrange(self.vocab_size))
            else:
                drafts.append(right)
        return drafts


class RepeatLastProposer(Proposer):
    """The smallest useful proposer: the last token, repeated (a tiny random
    model often repeats itself)."""

    description = "the last token, k times (testing)"

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [[r.last_token] * r.max_drafts for r in requests]


class TestProposers:
    """A runtime plugin registering the testing proposers (`reference`, `repeat_last`)."""

    @hookimpl
    def servelab_register_proposers(self):
        return {"reference": ReferenceProposer, "repeat_last": RepeatLastProposer}
