"""Speculative decoding's verification: which of a row's drafts the target keeps.

A decode with drafts d_1..d_k computes its last token and the drafts in one row
and samples at each of those k + 1 positions exactly as a decode would there
(the same logits processing over the tokens before it, the same rule, the same
seeded noise for the same output position), as if every draft before it were
kept: t_0..t_k. Draft d_i is kept while the target's own sample agrees with it
(t_{i-1} == d_i); the row keeps t_0..t_j, j the first disagreement (or k).

Every kept token is the token the target samples given the tokens before it,
so the output is the target's own:
- greedy: exactly the tokens without drafts;
- seeded sampling: exactly the tokens without drafts, as the noise is a function
  of (seed, output position, sample index) only;
- unseeded sampling: the target's distribution. For a single-token draft (every
  proposer here) this is rejection sampling (Leviathan et al. 2023) with a point
  mass q: draft d is kept with probability p(d) = min(1, p(d)/q(d)), and on a
  rejection the token is drawn from p without d, which is norm(max(0, p - q)).
Torch-free: the scheduler's side imports it too.
"""

from __future__ import annotations


def kept_tokens(samples: list[int], drafts: list[int]) -> list[int]:
    """The tokens a row keeps: `samples[i]` is the target's token at position i
    (after the last token and drafts[:i]); kept up to the first that differs from
    its draft, that one included."""
    kept = []
    for i, token in enumerate(samples):
        kept.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return kept


def kept_rows(samples: list[int], groups: list[tuple[int, list[int]]]) -> list[int]:
    """The sample rows a step keeps: every row, except that of each verify group
    `(first row, drafts)` (its rows first..first+len(drafts)) only those
    `kept_tokens` keeps."""
    rows: list[int] = []
    at = 0
    for first, drafts in groups:
        rows += range(at, first)
        kept = kept_tokens(samples[first : first + len(drafts) + 1], drafts)
        rows += range(first, first + len(kept))
        at = first + len(drafts) + 1
    rows += range(at, len(samples))
    return rows


class DraftedHistory:
    """A sequence as logits processing reads it at a draft position: its tokens
    followed by the drafts before that position."""

    def __init__(self, seq, drafts: list[int]) -> None:
        self.token_ids = seq.token_ids + drafts
        self.seq, self.drafts = seq, drafts  # a grammar's mask reads them (model.grammar)
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.eos_token_ids = seq.eos_token_ids
