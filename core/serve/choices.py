"""The choices of one API request as its engine requests' Deltas arrive: text
(through `StreamText`), token ids, logprobs and finish reasons per choice, and
the JSON pieces OpenAI's completion and chat shapes are made of. Choice `i*n+j`
is sample j of prompt i."""

from __future__ import annotations

from servelab.serve.async_engine import Delta
from servelab.serve.text import StreamText, token_text

# engine reasons as vLLM reports them; a request that outgrew the whole KV cache was
# stopped by the server, not by its length: "abort", with stop_reason "cache_full"
_REASONS = {"stop": "stop", "length": "length", "cache_full": "abort", "abort": "abort",
            "error": "error"}  # fmt: skip


class Choices:
    def __init__(self, tokenizer, prompts: list[list[int]], n: int, stops: list[str],
                 logprobs: int | None, chat: bool) -> None:  # fmt: skip
        self.tokenizer, self.n, self.logprobs, self.chat = tokenizer, n, logprobs, chat
        self.prompts = prompts
        count = len(prompts) * n
        self.texts = [StreamText(tokenizer, stops) for _ in range(count)]
        self.tokens: list[list[int]] = [[] for _ in range(count)]
        self.lps: list[list[dict]] = [[] for _ in range(count)]
        self.reasons: list[str | None] = [None] * count
        self.stop_reasons: list[str | None] = [None] * count
        self.finals: list[str | None] = [None] * count  # the engine's final texts
        self.error: str | None = None
        # echo with logprobs: each prompt's logprobs (from its engine request) and where
        # its choices' output offsets start (past the prompt tokens' texts, vLLM's rule)
        self.echo_logprobs = False
        self.prompt_lps: list[list | None] = [None] * len(prompts)
        self.bases = [0] * count

    def apply(self, prompt_index: int, delta: Delta) -> list[dict]:
        """Folds one Delta in; returns the stream pieces it makes, one per choice
        with news: {index, text, token_ids, logprobs, finish_reason}."""
        pieces = []
        finals = {}
        if delta.finished and delta.output is not None:
            finals = {c.index: c for c in delta.output.outputs}
            if self.echo_logprobs and self.prompt_lps[prompt_index] is None:
                self.prompt_lps[prompt_index] = delta.output.prompt_logprobs
            if delta.output.error and delta.output.finish_reason == "error":
                self.error = delta.output.error
        for sample in sorted(set(delta.new_tokens) | set(finals)):
            i = prompt_index * self.n + sample
            ids = delta.new_tokens.get(sample, [])
            lps = delta.new_logprobs.get(sample, [])
            self.tokens[i] += ids
            self.lps[i] += lps
            reason = stop_reason = None
            if sample in finals:  # the engine's text: a stop string's match cut off
                self.texts[i].token_ids += ids
                self.finals[i] = finals[sample].text
                text = self.texts[i].finish(finals[sample].text)
                engine_reason = finals[sample].finish_reason
                reason = self.reasons[i] = _REASONS.get(engine_reason, "stop")
                if engine_reason == "cache_full":
                    stop_reason = self.stop_reasons[i] = "cache_full"
            else:
                text = self.texts[i].push(ids)
            pieces.append({"index": i, "text": text, "token_ids": ids,
                           "logprobs": self.logprobs_json(
                               lps, self.bases[i] + len(self.texts[i].sent) - len(text)),
                           "finish_reason": reason, "stop_reason": stop_reason})  # fmt: skip
        return pieces

    def logprobs_json(self, entries: list[dict], offset: int = 0):
        if self.logprobs is None:
            return None
        tok = lambda t: token_text(self.tokenizer, t)
        if self.chat:
            return {"content": [
                {"token": tok(e["token_id"]), "logprob": e["logprob"],
                 "bytes": list(tok(e["token_id"]).encode()),
                 "top_logprobs": [{"token": tok(t), "logprob": lp, "bytes": list(tok(t).encode())}
                                  for t, lp in e["top"]]}
                for e in entries]}  # fmt: skip
        offsets, at = [], offset
        for e in entries:
            offsets.append(at)
            at += len(tok(e["token_id"]))
        return {
            "tokens": [tok(e["token_id"]) for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            # two tokens may decode to one string: the likelier keeps it (listed first)
            "top_logprobs": [_first_wins((tok(t), lp) for t, lp in e["top"]) for e in entries],
            "text_offset": offsets,
        }

    def prompt_logprobs_json(self, prompt_index: int, entries: list | None) -> dict:
        """An echoed prompt's completion logprobs (vLLM's shape): the first token's
        logprob None, offsets from the prompt's start, each token's text long. Sets
        where the prompt's choices' output offsets start."""
        ids = self.prompts[prompt_index]
        entries = entries if entries is not None else [None] * len(ids)
        self.prompt_lps[prompt_index] = entries
        texts = [token_text(self.tokenizer, t) for t in ids]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        for i in range(prompt_index * self.n, (prompt_index + 1) * self.n):
            self.bases[i] = at
        return {
            "tokens": texts,
            "token_logprobs": [None if e is None else e["logprob"] for e in entries],
            "top_logprobs": [None if e is None else _first_wins(
                (token_text(self.tokenizer, t), lp) for t, lp in e["top"]) for e in entries],
            "text_offset": offsets,
        }  # fmt: skip

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(t) for t in self.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}  # fmt: skip

    def final(self, echo_texts: list[str] | None = None) -> list[dict]:
        """The whole choices, for a response that does not stream."""
        out = []
        for i, text in enumerate(self.texts):
            body = self.finals[i] if self.finals[i] is not None else text.sent
            if echo_texts is not None:
                body = echo_texts[i // self.n] + body
            logprobs = None
            if self.logprobs is not None and self.echo_logprobs:
                logprobs = self.prompt_logprobs_json(i // self.n, self.prompt_lps[i // self.n])
                output = self.logprobs_json(self.lps[i], self.bases[i])
                logprobs = {key: logprobs[key] + output[key] for key in logprobs}
            elif self.logprobs is not None:
                logprobs = self.logprobs_json(self.lps[i])
            choice = {"index": i, "finish_reason": self.reasons[i],
                      "stop_reason": self.stop_reasons[i], "token_ids": self.tokens[i],
                      "logprobs": logprobs}  # fmt: skip
            if self.chat:
                choice["message"] = {"role": "assistant", "content": body}
            else:
                choice["text"] = body
            out.append(choice)
        return out


def _first_wins(pairs) -> dict:
    out: dict = {}
    for key, value in pairs:
        out.setdefault(key, value)
    return out
