"""A well-formed third-party plugin: a scheduler, an attention backend with
options, and an observer that takes fewer arguments than its hook spec."""

from servelab import hookimpl
from servelab.contracts.attention import AttentionBackend
from servelab.contracts.scheduler import Scheduler

STEPS_SEEN: list[dict] = []


class ShortestJobFirst(Scheduler):
    """Serves the shortest prompt first (a fake: it never schedules anything)."""

    def __init__(
        self,
        *,
        allocator,
        preemption,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        aging: float = 0.5,
    ):
        self.aging = aging

    def add(self, seq):
        pass

    def abort(self, request_id):
        return []

    def schedule(self):
        raise NotImplementedError

    def update(self, plan, sampled, now):
        return []

    def has_unfinished(self):
        return False


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
