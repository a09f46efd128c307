"""The embedded tiny models' tokenizer and chat template, so `model=tiny` takes
text, streams text and chats like a checkpoint with a tokenizer.json would.

A byte-level BPE (GPT-2's byte alphabet, so any text encodes) of exactly the
tiny shapes' 512 ids, trained on first use from the short corpus below with
Hugging Face `tokenizers`: deterministic (the same corpus, trainer settings and
library give the same merges), a fraction of a second, and no file shipped.
Its special tokens come first, so `<|endoftext|>` is id 1, the tiny shapes' EOS;
the chat template is ChatML, the format Qwen's checkpoints use. The weights are
random: the text a tiny model writes is noise in this vocabulary, but every path
a real model's text takes (tokenize, detokenize, stream, stop strings, chat)
runs on it.
"""

from __future__ import annotations

import functools

# ids 0..3, in this order: <|endoftext|> is 1, the tiny shapes' EOS token id
SPECIAL_TOKENS = ("<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
# the shapes that take it: each has a vocabulary of exactly VOCAB_SIZE ids
SHAPES = ("tiny", "tiny-llama", "tiny-qwen2")
VOCAB_SIZE = 512

# ChatML: each message `<|im_start|>role\ncontent<|im_end|>\n`, then the assistant's turn
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# What the merges are learnt from: plain English about the engine, a little code
# and a conversation, written for this purpose.
CORPUS = """\
An inference engine serves a language model to many users at once. Each request
brings a prompt; the engine computes the prompt's keys and values once, keeps
them in a cache, and then produces one new token per step until the request is
done. A scheduler decides which requests run in each step, an allocator decides
where their keys and values live, and an attention backend reads them back.
The user asks a question, and the assistant answers it. The user says hello,
and the assistant says hello back. The system says: you are a helpful
assistant. Answer briefly and clearly; if you do not know, say so.
Batching is what makes serving fast: a step that runs one token for each of
many requests costs little more than a step that runs one token for one
request, because the weights are read once for the whole batch. Prefix caching
lets requests that share the start of their prompt share its cache blocks.
Chunked prefill splits a long prompt into pieces so that short requests are
not stuck behind it. Preemption frees memory when the cache is full: a request
is swapped out to host memory or recomputed later.
def schedule(waiting, running, budget):
    for request in list(waiting):
        if request.tokens <= budget:
            running.append(request)
            waiting.remove(request)
            budget -= request.tokens
    return running
class Sequence:
    def __init__(self, prompt, max_tokens=16):
        self.token_ids = list(prompt)
        self.max_tokens = max_tokens
The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10
100 1000 3.14 2.72; punctuation, quotes "like this" and 'this', (brackets) and
[lists], {braces}, a - b + c * d / e = f, 50% of the time, questions? yes!
What is the capital of France? Paris is the capital of France. How many tokens
does this sentence have? It depends on the tokenizer. Thank you, you are welcome.
"""


@functools.cache
def tiny_tokenizer_json() -> str:
    """The trained tokenizer, serialised (tokenizer.json's content)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    return tokenizer.to_str()


def tiny_tokenizer():
    """A fresh `tokenizers.Tokenizer` of the tiny shapes (each caller its own:
    a tokenizer holds per-call state such as truncation and padding)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tiny_tokenizer_json())


def named_tokenizer(shape: str):
    """The tokenizer of a named shape: the tiny tokenizer for `SHAPES`, else None."""
    return tiny_tokenizer() if shape in SHAPES else None
