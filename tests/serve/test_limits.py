"""`longest_token_chars` bounds the text of any token sequence: a text of more
characters than `max_model_len` times it has more than `max_model_len` tokens."""

from __future__ import annotations

import random

from servelab.serve.limits import longest_token_chars

CORPUS = ["héllo wörld", "日本語のテキスト", "emoji 🙂🙃 and tabs\t\t", "    indented code():"] * 4


def test_no_text_has_more_characters_per_token_than_the_bound():
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1, show_progress=False)
    tok.add_special_tokens(["<|a-long-special-token|>"])
    bound = longest_token_chars(tok)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert bound == len("<|a-long-special-token|>")  # the longest entry: the special token
    singles = [tok.decode([t], skip_special_tokens=False) for t in range(vocab)]
    assert max(map(len, singles)) <= bound  # every token decoded alone
    rng = random.Random(0)
    for _ in range(200):  # and in context, cut UTF-8 sequences included
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        assert len(tok.decode(ids, skip_special_tokens=False)) <= bound * len(ids)
    assert longest_token_chars(None) == 1  # token ids only: one character a token
