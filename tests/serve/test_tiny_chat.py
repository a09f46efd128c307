"""The embedded tiny model chats through the official `openai` client, streamed and
not, with its own tokenizer and ChatML template: the text equals the offline run's
on the same rendered prompt."""

from __future__ import annotations

import openai
import pytest

from servelab import LLM, SamplingParams
from tests.serve.harness import Running, server_config

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
# what the ChatML template renders MESSAGES to, with the assistant's turn opened
RENDERED = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def server():
    with Running(server_config("tiny")) as s:
        yield s


def test_the_tiny_model_chats_streamed_and_not(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
    want = LLM(model="tiny", dtype="float64", max_model_len=256).generate(
        [RENDERED], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )[0]
    kw = dict(model=server.model_name, messages=MESSAGES, max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    got = client.chat.completions.create(**kw)
    assert server.model_name == "tiny"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
