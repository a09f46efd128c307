"""The OpenAI request shapes the server accepts, parsed the way vLLM's OpenAI server
parses them, and their translation to `SamplingParams`.

A field servelab knows and implements is typed and checked (a bad value is a 400
naming it); a field vLLM or OpenAI knows and servelab does not implement is accepted
at its neutral value and answers 400 "... is not supported by servelab" otherwise; a
field nobody knows is a 400 naming it. Errors are OpenAI's JSON:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servelab.errors import RequestError
from servelab.step.sequence import SamplingParams
from servelab.step.structured import StructuredOutputs


class ApiError(Exception):
    """An error answered in OpenAI's shape, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error",
                             404: "not_found_error", 413: "invalid_request_error",
                             429: "rate_limit_error"}.get(status, "server_error")  # fmt: skip

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # usage in every chunk (with include_usage)


# fields vLLM or OpenAI accept that servelab does not implement: the values that mean
# "not used" (anything else is a 400 "not supported by servelab")
NEUTRAL: dict[str, tuple] = {
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0, 1),
    "min_p": (None, 0.0, 0),
    "prompt_logprobs": (None,),
    "include_stop_str_in_output": (None, False),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None,),
    "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (None, False),
    "skip_special_tokens": (None, True),
    "chat_template": (None,),
    "documents": (None,),
    "continue_final_message": (None, False),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
}
# accepted and without effect on the tokens (bookkeeping a client may send)
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls",
           "spaces_between_special_tokens", "request_id", "cache_salt", "kv_transfer_params")  # fmt: skip


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    add_special_tokens: bool | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* fields (`constraint_of`); at most one of them
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # neutral-only and ignored fields (checked by `unsupported`)
    for _name in NEUTRAL:
        locals()[_name] = None
        __annotations__[_name] = Any
    for _name in IGNORED:
        locals()[_name] = None
        __annotations__[_name] = Any
    del _name


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates read it: content a string (text parts joined
        with newlines, vLLM's rule; null content is empty)."""
        message = self.model_dump(exclude_none=True)
        message["content"] = content_text(self.content)
        return message


def content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise ApiError(400, f"content part of type {kind!r} is not supported by servelab "
                           "(text parts only)", f"messages.content.{i}.type")  # fmt: skip
        if not isinstance(part.get("text"), str):
            raise ApiError(400, "a text content part needs a string `text`",
                           f"messages.content.{i}.text")  # fmt: skip
        texts.append(part["text"])
    return "\n".join(texts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    echo: bool | None = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


def unsupported(request: _Sampling) -> None:
    """A 400 for a field servelab does not implement, set to a value that would matter."""
    for name, neutral in NEUTRAL.items():
        value = getattr(request, name)
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise ApiError(400, f"{name}={value!r:.60} is not supported by servelab", name)
    if request.best_of is not None and request.best_of != request.n:
        raise ApiError(400, "best_of other than n is not supported by servelab", "best_of")
    if getattr(request, "echo", False) and isinstance(request, ChatRequest):
        raise ApiError(400, "echo in chat is not supported by servelab", "echo")


def sampling_params(request: _Sampling, max_tokens: int, logprobs: int | None,
                    max_n: int) -> SamplingParams:  # fmt: skip
    """The request's SamplingParams; a bad value is a 400 naming its field."""
    if request.n > max_n:
        raise ApiError(400, f"n must be at most {max_n}, got {request.n}", "n")

    def given(value, default):
        return default if value is None else value

    try:
        return SamplingParams(
            temperature=given(request.temperature, 1.0),
            top_p=given(request.top_p, 1.0),
            top_k=given(request.top_k, -1),
            n=request.n,
            seed=request.seed,
            max_tokens=max_tokens,
            stop=[] if request.stop is None else request.stop,
            stop_token_ids=request.stop_token_ids or [],
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            repetition_penalty=given(request.repetition_penalty, 1.0),
            frequency_penalty=given(request.frequency_penalty, 0.0),
            presence_penalty=given(request.presence_penalty, 0.0),
            min_tokens=request.min_tokens,
            logit_bias=request.logit_bias,
            structured_outputs=constraint_of(request),
        )
    except RequestError as err:  # its message starts with the field's name
        message = str(err)
        param = message.split(" ", 1)[0].split("[", 1)[0]
        raise ApiError(400, message, param) from None


# vLLM's structured_outputs fields that shape how a constraint compiles; servelab takes
# them at their defaults only
_VLLM_NEUTRAL_OPTIONS = {"disable_any_whitespace": (None, False, True),
                         "disable_fallback": (None, False, True),
                         "disable_additional_properties": (None, False),
                         "whitespace_pattern": (None,), "structural_tag": (None,)}  # fmt: skip


def constraint_of(request: _Sampling) -> StructuredOutputs | None:
    """The request's output constraint, from whichever of response_format,
    structured_outputs and guided_* it sets (a 400 when it sets several)."""
    found: list[tuple[str, StructuredOutputs]] = []
    fmt = request.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("response_format", StructuredOutputs(json_object=True)))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise ApiError(400, "response_format json_schema needs json_schema.schema (the "
                               "JSON schema)", "response_format.json_schema")  # fmt: skip
            found.append(("response_format", _constraint("response_format", {"json": schema})))
        elif kind != "text":
            raise ApiError(400, f"response_format.type={kind!r:.40}: one of text, json_object, "
                           "json_schema", "response_format.type")  # fmt: skip
    if request.structured_outputs is not None:
        options = dict(request.structured_outputs)
        for name, neutral in _VLLM_NEUTRAL_OPTIONS.items():
            value = options.pop(name, None)
            if value not in neutral:
                raise ApiError(400, f"structured_outputs.{name}={value!r:.40} is not supported "
                               "by servelab", f"structured_outputs.{name}")  # fmt: skip
        if options:
            found.append(("structured_outputs", _constraint("structured_outputs", options)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                       ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
        value = getattr(request, name)
        if value is not None:
            found.append((name, _constraint(name, {kind: value})))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ApiError(400, f"set one output constraint, not several ({names})", found[1][0])
    return found[0][1] if found else None


def _constraint(param: str, fields: dict) -> StructuredOutputs:
    try:
        constraint = StructuredOutputs.from_value(fields)
    except (RequestError, TypeError) as err:
        raise ApiError(400, f"{param}: {err}", param) from None
    assert constraint is not None
    return constraint


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """pydantic's first complaint as a 400 naming the field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('msg')}", None)
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"{param}: unknown field (servelab accepts vLLM's and OpenAI's "
                        "request fields; see docs/serving.md)", param)  # fmt: skip
    return ApiError(400, f"{param or 'body'}: {first.get('msg')}", param)


def prompts_of(prompt: Any) -> list[str | list[int]]:
    """A completion's prompt field as a list of prompts (text or token ids)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    return list(prompt)
