"""servelab.testing: the conformance kit for plugin authors.

From your own tests call `check_scheduler(MyScheduler, my_option=3)`, `check_allocator`,
`check_preemption`, `check_attention_backend`, `check_executor`, `check_router` or
`check_proposer`: each runs the part, combined with the built-ins, through the token-exact
oracle (transformers' greedy output of a tiny float64 Hugging Face checkpoint; for an
executor, the real executor's scheduling decisions) and the integrity and property checks;
a broken rule is an AssertionError saying which. The pieces are public too: `oracle`
(cases, combinations, `drive`), `allocator_machine` (the shadow-KV state machine),
`hf_reference` (tiny exact float64 checkpoints). They need `transformers` and
`hypothesis` (servelab's dev extra), imported when a check runs, with a clear error when
missing.
"""

from servelab.testing.conformance import (
    ConformanceReport,
    check_allocator,
    check_attention_backend,
    check_executor,
    check_preemption,
    check_proposer,
    check_router,
    check_scheduler,
    temporarily_registered,
)

__all__ = [
    "ConformanceReport",
    "check_allocator",
    "check_attention_backend",
    "check_executor",
    "check_preemption",
    "check_proposer",
    "check_router",
    "check_scheduler",
    "temporarily_registered",
]
