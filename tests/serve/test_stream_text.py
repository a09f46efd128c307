"""A stream's text deltas, decoded from a window of the newest tokens only, add up
to the whole output's text, never carry half a UTF-8 character, and hold back
what could still become a stop string."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.serve.text import StreamText


@pytest.fixture(scope="module")
def tokenizer(model_folder):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(model_folder / "tokenizer.json"))


def chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 3)
        out.append(ids[i : i + step])
        i += step
    return out


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab é€😀\n-", min_size=0, max_size=40), seed=st.integers(0, 99))
def test_deltas_add_up_to_the_whole_text(tokenizer, text, seed):
    ids = tokenizer.encode(text)
    stream = StreamText(tokenizer, stops=[])
    deltas = [stream.push(chunk) for chunk in chunks(ids, random.Random(seed))]
    whole = tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # the corpus text is valid UTF-8
    assert "".join(deltas) + stream.finish(whole) == whole
    # settled text is what decoding everything gives, never more
    assert whole.startswith("".join(deltas))


def test_split_characters_wait_for_their_last_byte(tokenizer):
    # byte-level BPE splits a 4-byte emoji over several tokens
    ids = tokenizer.encode("😀")
    assert len(ids) > 1
    stream = StreamText(tokenizer, stops=[])
    assert [stream.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.push(ids[-1:]) == "😀"


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    # the engine ends the request at the token that completes "-a", its text "ab"
    ids = tokenizer.encode("ab-a")
    stream = StreamText(tokenizer, stops=["-a", "xyz"])  # longest 3: hold 2 characters
    sent = "".join(stream.push([i]) for i in ids)
    assert "-" not in sent and "ab".startswith(sent)
    assert sent + stream.finish("ab") == "ab"


@pytest.mark.parametrize("text,stop", [("\n", "\n\n\n\n"), ("TT", "TTTT"), ("\u00e9 T", "TTTT"), ("caf\u00e9 T", "TTTT")])
def test_text_shorter_than_the_longest_stop_sends_nothing_early(tokenizer, text, stop):
    # fewer characters than the hold-back: none is settled yet (no negative slice)
    ids = tokenizer.encode(text)
    stream = StreamText(tokenizer, stops=[stop])
    sent = "".join(stream.push([i]) for i in ids)
    hold = len(stop) - 1
    assert sent == text[: max(0, len(text) - hold)]
