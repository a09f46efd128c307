"""Stop strings, searched incrementally: each step decodes only the new tokens
and searches only the text that can hold a new match.

A sample's text is its output tokens decoded as a whole (what the final output
carries). Decoding all of it every step costs in proportion to its length, so
instead each sequence keeps its place (`StopScan`, on `seq.stop_scan`), as
vLLM's incremental detokeniser does: the text of the tokens from `prefix` on,
minus that of the tokens from `prefix` to `read`, is the new text; decoding a
window that starts a few tokens back keeps what a token's text depends on (a
leading space, the bytes of a character split across tokens). A window ending
in a replacement character (an unfinished UTF-8 character) is not settled: its
text before that character is searched, and the window waits for more tokens.
A new match lies in the last `longest stop - 1` settled characters plus the new
text. On a match the text is decoded once, whole, and ends before the first
match (vLLM's rule); the token that completed the match is the last token.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.step.sequence import Sequence

REPLACEMENT = "\ufffd"


@dataclass
class StopScan:
    prefix: int = 0  # output tokens before the decode window
    read: int = 0  # output tokens whose text is settled
    tail: str = ""  # the settled text's last (longest stop - 1) characters


def new_text(tokenizer, ids, prefix: int, read: int) -> str:
    """The text `ids[read:]` adds, decoded in a window from `prefix` (< read keeps
    a token of context): the window's text past that of `ids[prefix:read]`."""
    settled = tokenizer.decode(ids[prefix:read])
    window = tokenizer.decode(ids[prefix:])
    return window[len(settled) :] if len(window) > len(settled) else ""


def find_stop(seq: Sequence, tokenizer) -> str | None:
    """The sample's text up to its first stop string, if its new tokens
    completed one; None otherwise (the scan's place moves on)."""
    stops = seq.params.stop
    scan = seq.stop_scan
    if scan is None:
        scan = seq.stop_scan = StopScan()
    start = seq.num_prompt_tokens
    ids = seq.token_ids
    new = new_text(tokenizer, ids, start + scan.prefix, start + scan.read)
    unfinished = new.endswith(REPLACEMENT)
    searched = scan.tail + (new.rstrip(REPLACEMENT) if unfinished else new)
    # no stop string ends the first min_tokens output tokens (vLLM's rule)
    if seq.num_output_tokens > seq.params.min_tokens and any(stop in searched for stop in stops):
        _cut_after_match(seq, tokenizer, scan.read + 1)
        return _text_before_first_stop(tokenizer.decode(seq.output_token_ids), stops)
    if new and not unfinished:
        keep = max(len(s) for s in stops) - 1
        scan.tail = searched[max(0, len(searched) - keep) :]
        scan.prefix, scan.read = scan.read, seq.num_output_tokens
    return None


def _cut_after_match(seq: Sequence, tokenizer, first: int) -> None:
    """Drops the output tokens after the one that completed the match. A step
    gives a sequence several tokens when it kept drafts (speculative decoding):
    the token that completes a match is the last, as it is one token at a time.
    `first`: the fewest output tokens that can hold a new match."""
    stops, start = seq.params.stop, seq.num_prompt_tokens
    outputs = seq.output_token_ids
    for count in range(max(first, seq.params.min_tokens + 1), len(outputs)):
        text = tokenizer.decode(outputs[:count])
        if any(stop in text for stop in stops):
            del seq.token_ids[start + count :]
            del seq.token_times[count:]
            if seq.logprobs is not None:
                del seq.logprobs[count:]
            return


def _text_before_first_stop(text: str, stops: list[str]) -> str | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(found)] if found else None
