"""The requests with structured outputs whose grammar is compiling: held here, not
in the scheduler, so a slow compile never holds up a step. `admit`, at the start of
each step, queues the requests whose grammar is ready and fails those whose compile
raised or ran past `compile_timeout_s` (only that request fails; the thread is left to
finish, its result then cached). The grammars, compiled once per (kind, spec) for the
model's tokenizer, are `servelab.model.grammar`'s. The engine is passed in, never
imported (an import cycle).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from typing import Any

from servelab.errors import RequestError
from servelab.model.grammar import Grammars
from servelab.step.sequence import SequenceGroup

COMPILE_TIMEOUT_S = 30.0
# an engine with nothing else to run waits this long on a compile before it looks again
IDLE_WAIT_S = 0.05


def cannot_constrain(executor) -> str | None:
    """Why an engine with `executor` cannot serve structured outputs (None: it can)."""
    if getattr(executor, "samples_stand_ins", False):
        return ("structured outputs need an executor that samples the model's logits; this "
                f"engine's executor ({type(executor).__name__}) samples stand-in tokens")  # fmt: skip
    if executor.tokenizer is None:
        return ("structured outputs need the model's tokenizer (tokenizer.json in the "
                "checkpoint folder); this model has none")  # fmt: skip
    return None


@dataclass
class Compiling:
    group: SequenceGroup
    future: Future
    started: float


class GrammarQueue:
    """An engine's grammar compiler and the requests waiting on it."""

    def __init__(self, engine: Any) -> None:
        executor = engine.executor
        problem = cannot_constrain(executor)
        if problem is not None:
            raise RequestError(problem)
        self.grammars = Grammars(
            executor.tokenizer, engine.model_config.vocab_size, sorted(engine.eos_token_ids)
        )
        self.compile_timeout_s = COMPILE_TIMEOUT_S
        self.waiting: dict[str, Compiling] = {}

    def add(self, group: SequenceGroup) -> None:
        """Checks the group's constraint (RequestError: invalid) and starts its compile."""
        self.waiting[group.request_id] = Compiling(group, self._start(group), time.monotonic())

    def compile_now(self, group: SequenceGroup) -> None:
        """Compiles the group's grammar in this thread (a request that arrives prefilled
        from another instance: it is queued at once)."""
        group.compiled_grammar = self._start(group).result(self.compile_timeout_s)

    def _start(self, group: SequenceGroup) -> Future:
        """The group's compiled grammar, to come (RequestError: its constraint is invalid)."""
        constraint = group.params.structured_outputs
        assert constraint is not None
        self.grammars.check(constraint)
        return self.grammars.submit(constraint)

    def admit(self, engine: Any, busy: bool) -> None:
        """Queues the ready requests in the scheduler, fails the broken ones; with
        nothing else to run (`busy` False), first waits a little for a compile."""
        if not busy:
            wait_for([c.future for c in self.waiting.values()], IDLE_WAIT_S, "FIRST_COMPLETED")
        now = time.monotonic()
        for request_id, compiling in list(self.waiting.items()):
            future, group = compiling.future, compiling.group
            if future.done():
                del self.waiting[request_id]
                error = future.exception()
                if error is None:
                    group.compiled_grammar = future.result()
                    engine.scheduler.add(group)
                else:
                    engine.fail_unqueued(group, f"structured_outputs: compiling the grammar "
                                                f"failed: {error}")  # fmt: skip
            elif now - compiling.started > self.compile_timeout_s:
                del self.waiting[request_id]
                engine.fail_unqueued(group, f"structured_outputs: compiling the grammar took "
                                            f"longer than {self.compile_timeout_s:g} s")  # fmt: skip

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Takes a waiting request out (its compile goes on, for the cache)."""
        compiling = self.waiting.pop(request_id, None)
        return None if compiling is None else compiling.group

    def stats(self) -> dict:
        s = self.grammars.stats
        return {
            "grammar_compiles": s.compiles,
            "grammar_cache_hits": s.cache_hits,
            "grammar_compile_s": s.compile_seconds,
            "grammar_compile_failures": s.failures,
            "grammar_waiting": len(self.waiting),
        }
