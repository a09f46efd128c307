"""A well-formed third-party plugin: a scheduler, an attention backend with
options, and an observer that takes fewer arguments than its hook spec."""

from servelab import hookimpl
from servelab.contracts.attention import AttentionBackend
from servelab.contracts.scheduler import SchedulingPolicy

STEPS_SEEN: list[dict] = []


class ShortestJobFirst(SchedulingPolicy):
    """Serves the shortest prompt first (a fake: it keeps the default hooks)."""

    def __init__(self, *, aging: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.aging = aging


class SlidingWindowAttention(AttentionBackend):
    """Attends to the last `window` tokens plus `sink_tokens` (a fake)."""

    def __init__(self, *, window: int = 128, sink_tokens: int = 4, **context):
        super().__init__(**context)
        self.window = window
        self.sink_tokens = sink_tokens

    def plan(self, meta):
        return None

    def forward(self, q, k, v, kv_cache, plan):
        raise NotImplementedError


@hookimpl
def servelab_register_schedulers():
    return {"fake_sjf": ShortestJobFirst}


@hookimpl
def servelab_register_attention_backends():
    return {"fake_window": SlidingWindowAttention}


@hookimpl
def servelab_step_end(step):
    STEPS_SEEN.append(step)
