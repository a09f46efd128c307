"""servelab.testing: the conformance kit for plugin authors.

    from servelab.testing import check_scheduler

    def test_my_scheduler():
        check_scheduler(MyScheduler, my_option=3)

`check_scheduler`, `check_allocator`, `check_preemption` and
`check_attention_backend` run a part, combined with the built-ins, through the
token-exact oracle (a tiny float64 Hugging Face checkpoint, transformers'
greedy output as the reference) and the integrity and property checks; a
broken rule is an AssertionError saying which. The reusable pieces are public
too: `oracle` (cases, combinations, `drive`), `allocator_machine` (the
shadow-KV state machine), `hf_reference` (tiny checkpoints, exact float64).

The kit needs `transformers` and `hypothesis` (servelab's dev extra); they
are imported when a check runs, with a clear error when missing.
"""

from servelab.testing.conformance import (
    ConformanceReport,
    check_allocator,
    check_attention_backend,
    check_preemption,
    check_scheduler,
    temporarily_registered,
)

__all__ = [
    "ConformanceReport",
    "check_allocator",
    "check_attention_backend",
    "check_preemption",
    "check_scheduler",
    "temporarily_registered",
]
