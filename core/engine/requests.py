"""What `Engine.add_request` checks before a request exists: every argument's
type and range, so nothing invalid ever reaches a step. Each check raises a
`RequestError` naming the request, the argument and what is accepted.

Prompts are text (with a tokenizer), or token ids as a list or tuple of
integers, or a 1-D integer numpy array or torch tensor; a bool is not a token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from servelab.errors import RequestError
from servelab.step.sequence import SamplingParams, finite_number, is_integer


def check_request_id(request_id: Any) -> str:
    if not (isinstance(request_id, str) or is_integer(request_id)):
        raise RequestError(f"request_id must be a string, got {request_id!r}")
    if request_id == "":
        raise RequestError("request_id must not be empty")
    return str(request_id)


def prompt_token_ids(prompt: Any, tokenizer, request_id: str) -> list[int]:
    """The prompt as a list of plain ints (vocabulary and length checked later)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError(
                f"request {request_id!r}: a text prompt needs a tokenizer, and this model has "
                "none (no tokenizer.json in its folder); pass token ids instead"
            )
        return list(tokenizer.encode(prompt).ids)
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        integer = (
            np.issubdtype(prompt.dtype, np.integer)
            if isinstance(prompt, np.ndarray)
            else not (prompt.dtype.is_floating_point or prompt.dtype.is_complex)
            and prompt.dtype != torch.bool
        )
        if prompt.ndim != 1 or not integer:
            raise RequestError(
                f"request {request_id!r}: a prompt array must be 1-D with an integer dtype, "
                f"got shape {tuple(prompt.shape)} and dtype {prompt.dtype}"
            )
        return [int(t) for t in prompt.tolist()]
    if not isinstance(prompt, (list, tuple)):
        raise RequestError(
            f"request {request_id!r}: a prompt is text or a list of token ids, "
            f"got {type(prompt).__name__}: {prompt!r:.80}"
        )
    if all(type(t) is int for t in prompt):  # the common case, without a check per type
        return list(prompt)
    bad = [t for t in prompt if not is_integer(t)]
    if bad:
        raise RequestError(
            f"request {request_id!r}: token ids must be integers, got {bad[0]!r} "
            f"({type(bad[0]).__name__})"
        )
    return [int(t) for t in prompt]


def checked_params(params: Any, request_id: str, vocab_size: int) -> SamplingParams:
    """A validated copy of `params` (None: the defaults); stop ids in the vocabulary."""
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise RequestError(
            f"request {request_id!r}: params must be a SamplingParams, got "
            f"{type(params).__name__} (build one: SamplingParams(**options))"
        )
    try:
        params = params.validated()
    except RequestError as err:
        raise RequestError(f"request {request_id!r}: {err}") from None
    outside = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if outside:
        raise RequestError(
            f"request {request_id!r}: stop token id {outside[0]} is outside the vocabulary "
            f"[0, {vocab_size})"
        )
    biased = [t for t in params.logit_bias or () if not 0 <= t < vocab_size]
    if biased:
        raise RequestError(
            f"request {request_id!r}: logit_bias token id {biased[0]} is outside the vocabulary "
            f"[0, {vocab_size})"
        )
    return params


def check_tokens(token_ids: list[int], request_id: str, vocab_size: int, max_model_len: int):
    if not token_ids:
        raise RequestError(f"request {request_id!r}: the prompt is empty")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"request {request_id!r}: token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})"
        )
    if len(token_ids) > max_model_len:
        raise RequestError(
            f"request {request_id!r}: prompt has {len(token_ids)} tokens, longer than "
            f"max_model_len={max_model_len}"
        )


def check_priority(priority: Any, request_id: str) -> int:
    if not is_integer(priority):
        raise RequestError(
            f"request {request_id!r}: priority must be an integer (lower runs first), "
            f"got {priority!r}"
        )
    return int(priority)


def check_arrival_time(arrival_time: Any, request_id: str) -> float | None:
    if arrival_time is None:
        return None
    number = finite_number(arrival_time)
    if number is None:
        raise RequestError(
            f"request {request_id!r}: arrival_time must be a finite number of seconds, "
            f"got {arrival_time!r}"
        )
    return number


def check_client(client: Any, request_id: str) -> str | None:
    """A client id is a non-empty string, or None (an anonymous request)."""
    if client is None:
        return None
    if not isinstance(client, str) or client == "":
        raise RequestError(
            f"request {request_id!r}: client must be a non-empty string or None, got {client!r}"
        )
    return client
