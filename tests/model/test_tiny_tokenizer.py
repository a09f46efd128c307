"""The tiny shapes' tokenizer: trained the same way every time, exactly their 512
ids, its EOS the shapes' EOS id, and any text through it and back unchanged."""

from __future__ import annotations

import json

from servelab.model import tiny_tokenizer
from servelab.model.config import named_config


def test_training_is_deterministic_and_fills_the_vocabulary():
    first = tiny_tokenizer.tiny_tokenizer_json.__wrapped__()  # two trainings, not the cache
    assert tiny_tokenizer.tiny_tokenizer_json.__wrapped__() == first
    vocab = json.loads(first)["model"]["vocab"]
    added = {t["content"]: t["id"] for t in json.loads(first)["added_tokens"]}
    assert len(vocab) == tiny_tokenizer.VOCAB_SIZE == 512
    assert sorted(vocab.values()) == list(range(512))
    assert added == {token: i for i, token in enumerate(tiny_tokenizer.SPECIAL_TOKENS)}


def test_its_eos_is_the_shapes_eos_and_it_fits_each_shape():
    tok = tiny_tokenizer.tiny_tokenizer()
    for shape in tiny_tokenizer.SHAPES:
        config = named_config(shape)
        assert config.vocab_size == tok.get_vocab_size() == 512
        assert config.eos_token_ids == [tok.token_to_id(tiny_tokenizer.EOS_TOKEN)]
    assert tiny_tokenizer.named_tokenizer("bench") is None  # other shapes have none


def test_any_text_round_trips():
    tok = tiny_tokenizer.tiny_tokenizer()
    for text in ["Hello, world!", "caf\u00e9 r\u00e9sum\u00e9 \u65e5\u672c\u8a9e \U0001f642",
                 "  tabs\tand\nnewlines  ", "def f(x):\n    return x * 2\n", ""]:  # fmt: skip
        ids = tok.encode(text).ids
        assert all(0 <= i < 512 for i in ids)
        assert tok.decode(ids) == text
    # the special tokens are single tokens, in chat text too
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n").ids
    assert ids[0] == 2 and 3 in ids
