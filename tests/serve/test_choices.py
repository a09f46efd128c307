"""How engine outcomes read to a client: vLLM's finish reasons (a request that
outgrew the KV cache is `abort` with stop_reason `cache_full`, not `length`), and
a completion's top_logprobs map keeping the likelier of two tokens with one text."""

from __future__ import annotations

from servelab.serve.async_engine import Delta
from servelab.serve.choices import Choices
from servelab.step.sequence import CompletionOutput, RequestOutput


class OneText:
    """A tokenizer under which tokens 1 and 2 both decode to "a"."""

    def decode(self, ids, **kw):
        return "".join({1: "a", 2: "a"}.get(i, "b") for i in ids)


def finished(reason: str, tokens: list[int], logprobs=None) -> Delta:
    output = RequestOutput("r", [5], [CompletionOutput(0, tokens, reason, "b" * len(tokens),
                                                       logprobs)], True)  # fmt: skip
    return Delta("r", new_tokens={0: tokens}, new_logprobs={0: logprobs or []},
                 finished=True, output=output)  # fmt: skip


def test_cache_full_is_abort_with_its_stop_reason_and_length_stays_length():
    for engine_reason, reason, stop_reason in [("cache_full", "abort", "cache_full"),
                                               ("length", "length", None)]:  # fmt: skip
        choices = Choices(OneText(), [[5]], 1, [], None, chat=False)
        (piece,) = choices.apply(0, finished(engine_reason, [3, 4]))
        assert (piece["finish_reason"], piece["stop_reason"]) == (reason, stop_reason)
        assert choices.final()[0]["finish_reason"] == reason


def test_top_logprobs_keep_the_likelier_of_two_tokens_with_one_text():
    entry = {"token_id": 1, "logprob": -0.1, "top": [(1, -0.1), (2, -3.0), (3, -4.0)]}
    choices = Choices(OneText(), [[5]], 1, [], 2, chat=False)
    choices.apply(0, finished("length", [1], [entry]))
    assert choices.final()[0]["logprobs"]["top_logprobs"] == [{"a": -0.1, "b": -4.0}]
