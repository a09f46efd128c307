"""Text around the engine: incremental detokenisation for streams and the chat
template. A stream decodes only a window of its newest tokens each step (as the
engine's stop-string scan does, `servelab.engine.stop_strings`): the window's
text past that of its already settled tokens is the new text, settled unless it
ends in a replacement character (an unfinished UTF-8 sequence: it waits for the
next tokens). Text that could still be the start of a stop string is held back;
the engine's final text (stop string excluded) closes the stream. Chat templates
are rendered with jinja2 in a sandbox, as Hugging Face's `apply_chat_template` does."""

from __future__ import annotations

import json
from pathlib import Path

from servelab.engine.stop_strings import new_text
from servelab.model import tiny_tokenizer
from servelab.serve.protocol import ApiError


class StreamText:
    """One sample's text as a stream of safe deltas."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.token_ids: list[int] = []
        self.prefix = self.read = 0  # the decode window starts at prefix; read: settled
        self.text = ""  # the settled text
        self.sent = ""

    def push(self, token_ids: list[int]) -> str:
        self.token_ids += token_ids
        if self.tokenizer is None:
            return ""
        new = new_text(self.tokenizer, self.token_ids, self.prefix, self.read)
        if new and not new.endswith("\ufffd"):
            self.text += new
            self.prefix, self.read = self.read, len(self.token_ids)
        text = self.text
        safe = text[: max(0, len(text) - self.hold)]  # never a negative slice
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def finish(self, final_text: str | None) -> str:
        """The rest of the text, given the engine's final one."""
        if final_text is None or not final_text.startswith(self.sent):
            return ""
        delta, self.sent = final_text[len(self.sent) :], final_text
        return delta


def token_text(tokenizer, token_id: int) -> str:
    return str(token_id) if tokenizer is None else tokenizer.decode([token_id])


class ChatTemplate:
    """The model folder's chat template, or none: `chat_template.jinja` (where
    transformers now saves it) first, else `chat_template` in tokenizer_config.json;
    for a named shape (no folder), its own (the tiny shapes': ChatML)."""

    def __init__(self, folder: str | Path | None, shape: str | None = None) -> None:
        self.template = None
        self.special: dict[str, str] = {}
        path = Path(folder) / "tokenizer_config.json" if folder else None
        config = json.loads(path.read_text()) if path is not None and path.is_file() else {}
        jinja = Path(folder) / "chat_template.jinja" if folder else None
        if jinja is not None and jinja.is_file():
            template = jinja.read_text()
        else:
            template = config.get("chat_template")
        if folder is None and shape in tiny_tokenizer.SHAPES:
            template = tiny_tokenizer.CHAT_TEMPLATE
            config = {"eos_token": tiny_tokenizer.EOS_TOKEN}
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                self.special[key] = value
        if template:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self.template = env.from_string(template)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               extra: dict | None = None) -> str:  # fmt: skip
        if self.template is None:
            raise ApiError(
                400,
                "this model has no chat template (no chat_template.jinja, no chat_template "
                "in its tokenizer_config.json); use /v1/completions with a prompt instead",
                "messages",
            )
        try:
            return self.template.render(
                **{**(extra or {}), **self.special},
                messages=messages,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as err:  # the template's own raise_exception, or a bad message
            raise ApiError(
                400, f"the chat template rejected the messages: {err}", "messages"
            ) from None
