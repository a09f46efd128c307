"""KV tiers change what is prefilled, never a token: the oracle (transformers'
float64 greedy tokens) with every built-in tier (host memory write-back and
write-through, a disk folder write-through and write-back, host over disk), on
the paged (hashed prefix caching) and radix allocators, under recompute, swap
and hybrid preemption, with whole-prompt and chunked prefills.

The oracle's prompts run twice, the second round after the first finished (a
conversation's next turn): the device cache (160 tokens) cannot keep the first
round's prefixes, so the second finds them evicted and, with a tier, loads them
back. Each run checks the allocator's and the tier's integrity after every step,
frees every device and host block by the end, and must have loaded from its tier.
"""

from __future__ import annotations

import itertools

import pytest

from servelab import LLM
from servelab.testing.oracle import (
    assert_no_leak,
    cached_case,
    combo_id,
    engine_options,
    restored_num_threads,
)

ALLOCATORS = [
    {"name": "paged", "block_size": 4, "prefix_caching": True},
    {"name": "radix", "page_size": 4},
    {"name": "radix", "page_size": 1},
]
PREEMPTION = [{"name": "recompute"}, {"name": "swap"}, {"name": "hybrid", "break_even_tokens": 16}]
SCHEDULERS = [
    {"name": "continuous", "admission": "on_demand"},
    {"name": "chunked", "admission": "on_demand", "chunk_size": 8},
]


TIERS = ["host", "host_write_through", "disk", "disk_write_back", "tiered"]
# host memory for swap and the host tier, in tokens of the oracle model's K/V (1 KiB each)
KIB = 1024


def tier_setup(which: str, folder) -> tuple[dict, dict]:
    """The tier's node and the engine options it runs with."""
    return {
        # the oracle's host pool (96 tokens): the tier evicts, and gives blocks back to swap
        "host": ({"name": "host"}, {}),
        # every computed block copied down: a pool that keeps a round's prefixes
        "host_write_through": (
            {"name": "host", "policy": "write_through"},
            {"swap_space": 512 * KIB},
        ),
        # every computed block written to a file, read back and checked on a hit
        "disk": ({"name": "disk", "path": str(folder)}, {}),
        "disk_write_back": ({"name": "disk", "path": str(folder), "policy": "write_back"}, {}),
        # host memory over the disk: the host pool (96 tokens) keeps the latest blocks
        "tiered": ({"name": "tiered", "path": str(folder)}, {}),
    }[which]


def run_rounds(combo: dict, rounds: int = 2, **engine) -> tuple[list[list[list[int]]], LLM]:
    """Every oracle prompt, `rounds` times (each round after the last finished);
    each round's first-sample tokens, in prompt order, and the LLM."""
    case = cached_case("qwen3")
    label = combo_id(combo)
    with restored_num_threads():
        llm = LLM(model=str(case.folder), **combo, **engine_options(combo, **engine))
        eng = llm.engine
        outputs = []
        for r in range(rounds):
            ids = [eng.add_request(p, sp) for p, sp in zip(case.prompts, case.params)]
            done: dict = {}
            for step in range(2000):
                if not eng.has_unfinished():
                    break
                for out in eng.step():
                    done[out.request_id] = out
                where = f"[{label}] round {r} step {step}"
                try:
                    eng.allocator.check_integrity()
                    eng.scheduler.check_integrity()
                    if eng.kv_tier is not None:
                        eng.kv_tier.check_integrity()
                except AssertionError as exc:
                    raise AssertionError(f"{where}: {exc}") from exc
            assert not eng.has_unfinished(), f"[{label}] round {r} did not end"
            outputs.append([done[i].outputs[0].token_ids for i in ids])
        assert_no_leak(eng.allocator, f"[{label}] after both rounds")
    return outputs, llm


COMBOS = [
    {"scheduler": s, "allocator": a, "preemption": p, "attention": {"name": "per_request"}}
    for a, p, s in itertools.product(ALLOCATORS, PREEMPTION, SCHEDULERS)
]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_every_tier_gives_the_oracles_tokens(combo, tier, tmp_path):
    case = cached_case("qwen3")
    node, engine = tier_setup(tier, tmp_path)
    combo = {**combo, "kv_tier": node}
    rounds, llm = run_rounds(combo, **engine)
    for r, tokens in enumerate(rounds):
        assert tokens == case.expected, f"[{combo_id(combo)}] round {r} differs from transformers"
    figures = llm.engine.kv_tier.figures
    assert figures.hits > 0, f"[{combo_id(combo)}] nothing was loaded from the tier: {figures}"
    assert figures.hit_tokens == figures.hits * llm.engine.allocator.block_size
    if tier == "tiered":  # both levels served: host memory first, the disk what it dropped
        stats = llm.engine.kv_tier.stats()
        assert stats["host_hits"] > 0 and stats["disk_hits"] > 0, stats


@pytest.mark.parametrize("tier", ["host", "tiered"])
@pytest.mark.parametrize("allocator", [ALLOCATORS[0], ALLOCATORS[1]], ids=str)
def test_a_decode_engine_with_a_tier_takes_handed_over_kv(allocator, tier, tmp_path):
    """Prefill/decode disaggregation with a tier on both engines: admitting a
    prefilled request may evict blocks into the tier and load others from it, and
    those copies run before its received K/V is written into its fresh blocks."""
    from servelab.testing.disaggregation import run_disaggregated

    node, engine = tier_setup(tier, tmp_path)
    combo = {**COMBOS[0], "allocator": allocator, "kv_tier": node}
    # a decode cache of one max_model_len: admitting a handover evicts the shared prefix
    small = {"kv_cache_memory": 64 * KIB}
    run = run_disaggregated(cached_case("qwen3"), combo, decode_overrides=small, **engine)
    assert run.tokens == cached_case("qwen3").expected
