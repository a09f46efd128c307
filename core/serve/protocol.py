"""The OpenAI request shapes the server accepts, checked strictly (an unknown or
mistyped field is a 400 naming it), and their translation to `SamplingParams`.
Errors are OpenAI's JSON: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servelab.errors import RequestError
from servelab.step.sequence import SamplingParams


class ApiError(Exception):
    """An error answered in OpenAI's shape, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error",
                             429: "rate_limit_error"}.get(status, "server_error")  # fmt: skip

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def sampling_params(request: _Sampling, max_tokens: int | None, logprobs: int | None,
                    max_n: int) -> SamplingParams:  # fmt: skip
    """The request's SamplingParams; a bad value is a 400 naming its field."""
    if request.n > max_n:
        raise ApiError(400, f"n must be at most {max_n}, got {request.n}", "n")
    try:
        return SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            n=request.n,
            seed=request.seed,
            max_tokens=16 if max_tokens is None else max_tokens,
            stop=[] if request.stop is None else request.stop,
            stop_token_ids=request.stop_token_ids or [],
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
        )
    except RequestError as err:  # its message starts with the field's name
        raise ApiError(400, str(err), str(err).split(" ", 1)[0]) from None


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """pydantic's first complaint as a 400 naming the field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('msg')}", None)
    return ApiError(400, f"{param or 'body'}: {first.get('msg')}", param)


def prompts_of(prompt: Any) -> list[str | list[int]]:
    """A completion's prompt field as a list of prompts (text or token ids)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    return list(prompt)
