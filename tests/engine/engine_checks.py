"""Checks the engine tests share."""

from __future__ import annotations

from servelab import LLM


def assert_engine_clean(llm: LLM) -> None:
    """Nothing left running, every invariant true, every KV block free again."""
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.groups
    engine.allocator.check_integrity()
    engine.scheduler.check_integrity()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks, "a KV block leaked"
