"""`ngram`: prompt lookup decoding (Saxena 2023; vLLM's `ngram` method). The drafts
are the tokens that followed an earlier occurrence of the request's last n tokens,
trying the longest n first (`max_n` down to `min_n`), in its prompt and output
alike: the latest occurrence (`match: latest`, the default), or the earliest
(`match: earliest`, as vLLM's V1 n-gram proposer picks). No model: it pays where outputs copy their context (code
edits, summaries quoting the source, retrieval answers).

Each sequence keeps an index of its n-grams, {n-gram: where it last ended},
extended by the tokens that arrived since its last step, so a proposal costs a
few dictionary lookups whatever the sequence's length.
"""

from __future__ import annotations

from servelab.contracts.hookspecs import hookimpl
from servelab.contracts.proposer import DraftRequest, Proposer
from servelab.errors import ConfigError

MATCHES = ("latest", "earliest")


class NgramIndex:
    """One sequence's n-grams of lengths min_n..max_n, each mapped to the position
    of its last token at its latest (or `earliest`) occurrence, for n-grams ending
    before the sequence's last token (so the suffix never finds itself)."""

    def __init__(self, min_n: int, max_n: int, earliest: bool = False) -> None:
        self.lengths = range(min_n, max_n + 1)
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`
        self.earliest = earliest

    def extend(self, tokens) -> None:
        """Indexes the n-grams ending at positions indexed..len(tokens)-2."""
        ends = self.ends
        keep = ends.setdefault if self.earliest else ends.__setitem__  # first or last seen
        for end in range(self.indexed, len(tokens) - 1):
            for n in self.lengths:
                if end + 1 >= n:
                    keep(tuple(tokens[end + 1 - n : end + 1]), end)
        self.indexed = max(self.indexed, len(tokens) - 1)

    def continuation(self, tokens, limit: int) -> list[int]:
        """Up to `limit` tokens after the latest (earliest) earlier occurrence of the
        longest suffix found."""
        for n in reversed(self.lengths):
            if n > len(tokens):
                continue
            end = self.ends.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return list(tokens[end + 1 : end + 1 + limit])
        return []


class NgramProposer(Proposer):
    description = "prompt lookup: the tokens after the last n tokens' latest earlier occurrence"

    def __init__(self, min_n: int = 1, max_n: int = 3, match: str = "latest", **common) -> None:
        super().__init__(**common)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if match not in MATCHES:
            raise ConfigError(
                f"proposer ngram: match must be one of {', '.join(MATCHES)}, got {match!r}"
            )
        self.min_n, self.max_n, self.match = min_n, max_n, match
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts = []
        for request in requests:
            index = self.indexes.get(request.seq_id)
            if index is None or index.indexed > len(request.token_ids):
                index = self.indexes[request.seq_id] = NgramIndex(
                    self.min_n, self.max_n, earliest=self.match == "earliest"
                )
            index.extend(request.token_ids)
            drafts.append(index.continuation(request.token_ids, request.max_drafts))
        return drafts

    def on_finish(self, seq_id: int) -> None:
        self.indexes.pop(seq_id, None)


@hookimpl
def servelab_register_proposers():
    return {"ngram": NgramProposer}
