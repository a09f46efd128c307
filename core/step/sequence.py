"""A request's sequences, their status machine, sampling parameters and outputs.

A `Sequence` is one token stream whose KV lives in the cache. A request with
`SamplingParams.n > 1` becomes a `SequenceGroup` of n sequences that share their prompt
blocks after the prompt is prefilled once. The one counter that drives scheduling is
`num_computed_tokens`: how many of `token_ids` already have their K/V in the cache. A step
runs tokens `[num_computed_tokens, num_computed_tokens + k)`; when that range reaches the end
of `token_ids`, the step samples the next token. Prefill, chunked prefill, decode and
recompute after preemption are all this one rule.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from servelab.errors import RequestError
from servelab.step.structured import StructuredOutputs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # Engine.abort
    CACHE_FULL = "cache_full"  # outgrew the whole KV cache (on_demand admission)
    REJECTED = "rejected"  # bad request, never ran
    ERROR = "error"  # a step that ran it raised (the output's `error` says where)


@dataclass
class SamplingParams:
    """How to pick tokens. `temperature == 0` is greedy."""

    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    max_tokens: int = 16
    n: int = 1
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # text that ends the request at its first match (excluded from the text)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's and the top k
    # None: none; k >= 0: each prompt token's logprob and the top k (vLLM's prompt_logprobs)
    prompt_logprobs: int | None = None
    # logits processing before temperature (vLLM's and OpenAI's meanings; 1.0 / 0 / None: off)
    repetition_penalty: float = (
        1.0  # > 0: a seen token's (prompt or output) logit / p if > 0, * p else
    )
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times the token's count in the output
    presence_penalty: float = 0.0  # in [-2, 2]: minus this once the token is in the output
    min_tokens: int = 0  # no EOS, stop token or stop string before this many output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # False: this request gets no speculative drafts (the engine's proposer skips it)
    speculative: bool = True
    # the output's constraint: a JSON schema, regex, choice or grammar (`step.structured`);
    # a dict of its fields is taken too
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        """Checks every field: a bad value is a RequestError naming the field,
        here at construction. Values become plain Python ones (numpy integers
        become ints, `stop_token_ids` a list). A bool is not a number here, and
        no string is read as one."""
        for name, value in self._checked().items():
            setattr(self, name, value)

    def validated(self) -> SamplingParams:
        """A checked copy: the fields may have been changed since construction."""
        return dataclasses.replace(self)

    def _checked(self) -> dict:
        return dict(
            temperature=_real(
                "temperature", self.temperature, ">= 0 (0 is greedy)", lambda x: x >= 0
            ),
            top_k=_integer("top_k", self.top_k, "-1 or 0 (off) or >= 1", lambda x: x >= -1),
            top_p=_real("top_p", self.top_p, "in (0, 1]", lambda x: 0 < x <= 1),
            max_tokens=_integer("max_tokens", self.max_tokens, ">= 1", lambda x: x >= 1),
            n=_integer("n", self.n, ">= 1", lambda x: x >= 1),
            seed=None if self.seed is None else _integer("seed", self.seed, "or None", None),
            stop_token_ids=_token_list("stop_token_ids", self.stop_token_ids),
            ignore_eos=_flag("ignore_eos", self.ignore_eos),
            stop=_text_list("stop", self.stop),
            logprobs=None
            if self.logprobs is None
            else _integer("logprobs", self.logprobs, "in [0, 20] or None", lambda x: 0 <= x <= 20),
            prompt_logprobs=None
            if self.prompt_logprobs is None
            else _integer(
                "prompt_logprobs",
                self.prompt_logprobs,
                "in [0, 20] or None",
                lambda x: 0 <= x <= 20,
            ),
            repetition_penalty=_real(
                "repetition_penalty", self.repetition_penalty, "> 0 (1 is off)", lambda x: x > 0
            ),
            frequency_penalty=_real(
                "frequency_penalty", self.frequency_penalty, "in [-2, 2]", lambda x: -2 <= x <= 2
            ),
            presence_penalty=_real(
                "presence_penalty", self.presence_penalty, "in [-2, 2]", lambda x: -2 <= x <= 2
            ),
            min_tokens=_integer(
                "min_tokens",
                self.min_tokens,
                f">= 0 and <= max_tokens={self.max_tokens}",
                lambda x: 0 <= x and (not is_integer(self.max_tokens) or x <= self.max_tokens),
            ),
            logit_bias=_bias("logit_bias", self.logit_bias),
            speculative=_flag("speculative", self.speculative),
            structured_outputs=_constraint(self.structured_outputs, self.ignore_eos,
                                           self.min_tokens),
        )

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processing (penalties, min_tokens, logit_bias, a
        structured-outputs mask) is on."""
        return self.adjusts_logits or self.structured_outputs is not None

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties, min_tokens or logit_bias change the logits' values."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.min_tokens > 0
            or bool(self.logit_bias)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def is_integer(value) -> bool:
    """An integer (numpy's too), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def finite_number(value) -> float | None:
    """`value` as a float when it is a finite real number (not a bool, not an int
    too large for a float); None otherwise."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _integer(name: str, value, rule: str, ok) -> int:
    if not is_integer(value) or (ok is not None and not ok(int(value))):
        raise RequestError(f"{name} must be an integer {rule}, got {value!r}")
    return int(value)


def _real(name: str, value, rule: str, ok) -> float:
    number = finite_number(value)
    if number is None or not ok(number):
        raise RequestError(f"{name} must be a finite number {rule}, got {value!r}")
    return number


def _flag(name: str, value) -> bool:
    if not isinstance(value, (bool, numbers.Integral)) or value not in (0, 1):
        raise RequestError(f"{name} must be true or false, got {value!r}")
    return bool(value)


def _token_list(name: str, value) -> list[int]:
    """A list of token ids (any iterable of integers but a string or mapping)."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise RequestError(f"{name} must be a list of token ids, got {value!r}")
    items = list(value)
    bad = [t for t in items if not is_integer(t)]
    if bad:
        raise RequestError(f"{name} must be a list of integer token ids, got {bad[0]!r} in it")
    return [int(t) for t in items]


def _bias(name: str, value) -> dict[int, float] | None:
    """A map of token id (an integer, or its decimal string as JSON sends it) to a bias."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(f"{name} must be a map of token id to bias, got {value!r:.80}")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not is_integer(token) or token < 0:
            raise RequestError(f"{name} keys must be token ids (integers >= 0), got {key!r:.40}")
        out[int(token)] = _real(
            f"{name}[{key}]", bias, "in [-100, 100]", lambda x: -100 <= x <= 100
        )
    return out or None


def _constraint(value, ignore_eos, min_tokens) -> StructuredOutputs | None:
    if value is None:
        return None
    constraint = StructuredOutputs.from_value(value)
    # a constrained output ends when its structure is complete, with EOS: neither
    # option could hold it open without breaking the structure
    if constraint is not None and ignore_eos is True:
        raise RequestError("structured_outputs with ignore_eos: a constrained output ends when "
                           "its structure is complete, with EOS; drop ignore_eos")  # fmt: skip
    if constraint is not None and is_integer(min_tokens) and min_tokens > 0:
        raise RequestError("structured_outputs with min_tokens: a constrained output ends when "
                           "its structure is complete, with EOS, however short; drop "
                           "min_tokens")  # fmt: skip
    return constraint


def _text_list(name: str, value) -> list[str]:
    """A list of non-empty strings (one string is a list of one)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(t, str) and t for t in items):
        raise RequestError(f"{name} must be a non-empty string or a list of them, got {value!r}")
    return list(items)


_seq_ids = itertools.count()


class Sequence:
    """One token stream. Its KV blocks are known to the allocator by `seq_id`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float = 0.0,
        priority: int = 0,
        sample_index: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        client: str | None = None,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.sample_index = sample_index  # which of the n samples
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        self.priority = priority
        self.client = client  # who sent it (fair schedulers count service per client)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        self.num_cached_tokens = 0  # tokens served by the prefix cache (latest admission)
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.grammar_state: Any = None  # structured outputs: its matcher (model.grammar)
        # speculative decoding: this step's drafts (the scheduler core sets and clears
        # them), and the drafts verified and accepted so far
        self.draft_tokens: list[int] = []
        # their draft probabilities ([drafts, vocab], `contracts.proposer.Draft.probs`) or
        # None; set with draft_tokens, read only for the drafts the step kept
        self.draft_probs: Any = None
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0
        self.group: SequenceGroup | None = None
        # timing, filled by the engine
        self.first_scheduled_time: float | None = None
        self.token_times: list[float] = []
        self.finished_time: float | None = None
        self.stop_text: str | None = None  # the text up to a matched stop string
        # the stop-string search's place (a servelab.engine.stop_strings.StopScan)
        self.stop_scan: Any = None
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        # when asked for: one entry per prompt token, the first None (nothing precedes it);
        # the executor appends the rest as the prompt's chunks are computed
        self.prompt_logprobs: list[dict | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )

    # -- sizes
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """True when its next step is a decode (`servelab.step.plan`): only its last
        token, a sampled one, lacks K/V."""
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def stop_reason(self, max_model_len: int) -> FinishReason | None:
        """Why the sequence stops after its last token: a stop token, or its length."""
        token = self.token_ids[-1]
        params = self.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            return FinishReason.STOP
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, reason: FinishReason) -> None:
        """Marks the sequence finished (its owner frees its blocks)."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def fork(self, sample_index: int, params: SamplingParams) -> Sequence:
        """A copy sharing history (the allocator shares its blocks separately)."""
        child = Sequence(
            self.request_id,
            self.token_ids[: self.num_prompt_tokens],
            params,
            self.arrival_time,
            self.priority,
            sample_index,
            self.eos_token_ids,
            self.client,
        )
        child.token_ids = list(self.token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.first_scheduled_time = self.first_scheduled_time
        child.token_times = list(self.token_times)
        if self.logprobs is not None:
            child.logprobs = list(self.logprobs)
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


class SequenceGroup:
    """The n samples of one request. One sequence until it is forked after prefill."""

    def __init__(self, request_id: str, first: Sequence) -> None:
        self.request_id = request_id
        self.seqs: list[Sequence] = [first]
        first.group = self
        # structured outputs: the compiled grammar (the engine queues the group once set)
        self.compiled_grammar: Any = None

    @property
    def params(self) -> SamplingParams:
        return self.seqs[0].params

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def needs_fork(self) -> bool:
        return len(self.seqs) < self.params.n

    @property
    def priority(self) -> int:
        return self.seqs[0].priority

    @property
    def arrival_time(self) -> float:
        return self.seqs[0].arrival_time

    @property
    def client(self) -> str | None:
        return self.seqs[0].client

    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_swapped(self) -> bool:
        """Swapped out (its unfinished samples' K/V in host memory), waiting to resume."""
        return any(s.status is SequenceStatus.SWAPPED for s in self.seqs)

    @property
    def num_unfinished(self) -> int:
        """`len(unfinished())` without the list (counted every step for every group)."""
        seqs = self.seqs
        if len(seqs) == 1:
            return 0 if seqs[0].status is SequenceStatus.FINISHED else 1
        return sum(s.status is not SequenceStatus.FINISHED for s in seqs)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None
    text: str | None = None
    # per token: {"token_id", "logprob", "top": [(token_id, logprob), ...]}; None: not asked
    logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt. `token_ids` is the first sample's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    # per prompt token, when asked for (`SamplingParams.prompt_logprobs`): None for the
    # first, then {"token_id", "logprob", "top"} as in `CompletionOutput.logprobs`
    prompt_logprobs: list[dict | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else FinishReason.REJECTED.value

    @property
    def text(self) -> str | None:
        return self.outputs[0].text if self.outputs else None
