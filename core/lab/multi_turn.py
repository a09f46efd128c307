"""The `multi_turn` workload: prompts that repeat what earlier prompts sent,
the case prefix caches are built for.

- `variant: conversation`: `num_conversations` chats, each `turns` turns; every
  turn resends the whole history (one system prompt shared by every chat, then
  each earlier turn's message and reply) plus a new message. A workload is
  built before the run (open loop), so a reply in the history is a stand-in of
  `output_len` tokens, not what the model will generate (with `closed_loop`, it
  is the reply generated): a cache can reuse the system prompt and every earlier
  turn's message and reply.
- `variant: few_shot`: `num_conversations * turns` requests, each the system
  prompt, then all `num_examples` shared examples in an order of its own, then
  a question: requests share the system prompt and as many leading examples as
  their orders share.

Conversations start at the times of `arrival` (`poisson` of rate `rate`, or
`all_at_once`). Open loop (the default), turn k of a chat arrives `k *
think_time` seconds after its start. With `closed_loop`, a chat's next turn is
sent `think_time` seconds after its previous turn finished, and its history
holds the replies the model generated (servelab.lab.arrivals): a turn then
never arrives before the one it continues was served, whatever the machine's
speed. Seeded like every workload.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from servelab.errors import ConfigError
from servelab.lab.distributions import arrival_times
from servelab.lab.request_builder import RequestBuilder, WorkloadRequest, check_int
from servelab.step.sequence import finite_number

VARIANTS = ("conversation", "few_shot")


def multi_turn_workload(
    vocab_size: int,
    max_model_len: int | None = None,
    variant: str = "conversation",
    num_conversations: int = 8,
    turns: int = 4,
    system_prompt_len: int = 40,
    message_len: int = 12,
    output_len: int = 12,
    num_examples: int = 4,
    example_len: int = 20,
    arrival: str = "poisson",
    rate: float = 4.0,
    think_time: float = 0.5,
    closed_loop: bool = False,
    seed: int = 0,
    temperature: float = 0.0,
    ignore_eos: bool = True,
) -> list[WorkloadRequest]:
    """Multi-turn chats or few-shot prompts (module docstring), sorted by arrival."""
    if variant not in VARIANTS:
        raise ConfigError(
            f"workload multi_turn: unknown variant {variant!r}; accepted: {', '.join(VARIANTS)}"
        )
    for name, value, low in (
        ("num_conversations", num_conversations, 1),
        ("turns", turns, 1),
        ("system_prompt_len", system_prompt_len, 0),
        ("message_len", message_len, 1),
        ("output_len", output_len, 1),
        ("num_examples", num_examples, 1),
        ("example_len", example_len, 1),
    ):
        check_int(f"workload multi_turn: {name}", value, low)
    think = finite_number(think_time)
    if think is None or think < 0:
        raise ConfigError(
            f"workload multi_turn: think_time must be a finite number >= 0, got {think_time!r}"
        )
    build = RequestBuilder(vocab_size, max_model_len, seed, temperature, ignore_eos)
    starts = arrival_times(num_conversations, arrival, rate, 1.0, build.rng)
    system = build.random_prompt(system_prompt_len)
    shape = _Turns(turns, message_len, output_len, think, bool(closed_loop))
    if variant == "conversation":
        requests = _conversations(build, system, starts, shape)
    else:
        examples = [build.random_prompt(example_len) for _ in range(num_examples)]
        requests = _few_shot(build, system, examples, starts, shape)
    # timed requests by arrival; follow-ups (closed loop) after them, their times are delays
    return sorted(requests, key=lambda r: (r.after is not None, r.arrival_time))


class _Turns(NamedTuple):
    """Each conversation's turns: how many, their lengths, the time between them,
    and whether a turn waits for the previous one's reply (closed loop)."""

    turns: int
    message_len: int
    output_len: int
    think: float
    closed_loop: bool


def _timing(start: float, k: int, shape: _Turns, previous: str) -> dict[str, Any]:
    """Turn k's arrival: k think times after the chat's start (open loop), or
    one think time after the previous turn finished (closed loop)."""
    if not shape.closed_loop or k == 0:
        return {"arrival_time": float(start) + k * shape.think}
    return {"arrival_time": shape.think, "after": previous}


def _conversations(
    build: RequestBuilder, system: list[int], starts: Any, shape: _Turns
) -> list[WorkloadRequest]:
    turns, message_len, output_len = shape.turns, shape.message_len, shape.output_len
    requests = []
    for c, start in enumerate(starts):
        history = list(system)
        for k in range(turns):
            message = build.random_prompt(message_len)
            history += message
            if build.max_model_len is not None and len(history) + output_len > build.max_model_len:
                break  # the chat outgrew the engine: it ends here (a reply is at most output_len)
            index = c * turns + k
            # closed loop, a later turn sends its message only: the runner puts the
            # history (the previous turn's prompt and generated reply) in front
            continues = shape.closed_loop and k > 0
            requests.append(
                build.request(
                    index,
                    message if continues else list(history),
                    output_len,
                    request_id=f"chat-{c}-turn-{k}",
                    meta={"conversation": c, "turn": k},
                    continues=continues,
                    **_timing(start, k, shape, f"chat-{c}-turn-{k - 1}"),
                )
            )
            history += build.random_prompt(output_len)  # the reply's stand-in
    return requests


def _few_shot(
    build: RequestBuilder, system: list[int], examples: list[list[int]], starts: Any, shape: _Turns
) -> list[WorkloadRequest]:
    turns, message_len, output_len = shape.turns, shape.message_len, shape.output_len
    requests = []
    for c, start in enumerate(starts):
        for k in range(turns):
            order = build.rng.permutation(len(examples)).tolist()
            shots = [t for i in order for t in examples[i]]
            index = c * turns + k
            requests.append(
                build.random_request(
                    index,
                    message_len,
                    output_len,
                    prefix=system + shots,
                    request_id=f"fewshot-{c}-{k}",
                    meta={"order": order},
                    **_timing(start, k, shape, f"fewshot-{c}-{k - 1}"),
                )
            )
    return requests
