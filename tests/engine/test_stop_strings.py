"""Stop strings searched incrementally give exactly the results of the plain
rule: after each step decode the whole output, and at the first step whose text
holds a stop string, the text ends before the first match and the tokens end
with the token that completed it (vLLM's rule). Checked over random outputs of
a byte-level tokenizer, whose tokens split multi-byte characters, with stop
strings taken across token boundaries; and each step decodes a few tokens only,
whatever the output's length."""

from __future__ import annotations

import random

import pytest

from servelab.engine.stop_strings import find_stop
from servelab.step.sequence import SamplingParams, Sequence
from tests.serve.harness import CORPUS

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=320, min_frequency=1, show_progress=False)
    return tok


def plain_rule(tokenizer, output: list[int], stops: list[str]) -> tuple[int, str] | None:
    """(tokens kept, text) by decoding the whole output after every token."""
    for k in range(1, len(output) + 1):
        text = tokenizer.decode(output[:k])
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return k, text[: min(found)]
    return None


def incremental(tokenizer, output: list[int], stops: list[str]) -> tuple[int, str] | None:
    """(tokens kept, text) feeding one token per step to `find_stop`."""
    seq = Sequence("r", PROMPT, SamplingParams(stop=stops, max_tokens=len(output)))
    for k, token in enumerate(output, start=1):
        seq.append_token(token)
        text = find_stop(seq, tokenizer)
        if text is not None:
            return k, text
    return None


def random_output(rng: random.Random, tokenizer, length: int) -> list[int]:
    """Mostly the corpus's own tokens (real words, multi-byte characters), some random."""
    words = tokenizer.encode(rng.choice(CORPUS)).ids
    output = []
    while len(output) < length:
        if rng.random() < 0.8:
            start = rng.randrange(len(words))
            output += words[start : start + rng.randint(1, 6)]
        else:
            output.append(rng.randrange(tokenizer.get_vocab_size()))
    return output[:length]


def stops_for(rng: random.Random, text: str) -> list[str]:
    clean = text.replace("\ufffd", "")
    stops = ["never there \u00a7"]
    for _ in range(rng.randint(1, 3)):
        if len(clean) < 2:
            break
        size = rng.randint(1, min(6, len(clean) - 1))
        start = rng.randrange(len(clean) - size)
        stops.append(clean[start : start + size])
    return stops


def test_incremental_search_gives_the_plain_rule_on_random_outputs(tokenizer):
    rng = random.Random(0)
    matched = crossing = multibyte = 0
    for _ in range(400):
        output = random_output(rng, tokenizer, rng.randint(1, 40))
        stops = stops_for(rng, tokenizer.decode(output))
        want = plain_rule(tokenizer, output, stops)
        assert incremental(tokenizer, output, stops) == want, (output, stops)
        if want is not None:
            matched += 1
            kept, text = want
            last = tokenizer.decode(output[kept - 1 : kept])
            crossing += not any(s in last for s in stops)  # no token holds the match alone
            multibyte += any(ord(c) > 127 for s in stops for c in s)
    # the cases the rule is about were exercised, not assumed
    assert matched > 200 and crossing > 50 and multibyte > 20


def byte_level_char(byte: int) -> str:
    """The character GPT-2's byte-level alphabet writes a byte as."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def test_a_stop_string_across_a_split_multibyte_character(tokenizer):
    text = "caf\u00e9 \u65e5\u672c\u8a9e \U0001f600 ok"
    # one token per byte (a byte-level vocabulary holds all 256): every multi-byte
    # character is split across tokens
    output = [tokenizer.token_to_id(byte_level_char(b)) for b in text.encode()]
    assert None not in output and tokenizer.decode(output) == text
    assert len(output) > len(text)
    for stop in ("\u00e9 ", "\u672c", "\U0001f600", "\u8a9e \U0001f600 o"):
        kept, got = incremental(tokenizer, output, [stop])
        assert (kept, got) == plain_rule(tokenizer, output, [stop])
        assert got == text[: text.find(stop)]
        assert tokenizer.decode(output[:kept]).endswith(stop)  # the last byte completed it


def test_each_step_decodes_a_few_tokens_whatever_the_length(tokenizer):
    class Counting:
        def __init__(self, tok):
            self.tok, self.longest = tok, 0

        def decode(self, ids):
            self.longest = max(self.longest, len(ids))
            return self.tok.decode(ids)

    words = tokenizer.encode(" ".join(CORPUS)).ids
    output = (words * 20)[:600]
    counting = Counting(tokenizer)
    assert incremental(counting, output, ["never there \u00a7", "zz"]) is None
    assert counting.longest <= 8  # a window, not the 600 tokens decoded so far
    kept, text = incremental(counting, output, ["lazy dog"])  # a match decodes once, whole
    assert (kept, text) == plain_rule(tokenizer, output, ["lazy dog"])
