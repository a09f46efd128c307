"""A server restarted on the same `disk` tier folder answers a long prompt it
answered before with that prompt's prefix loaded from the folder, not
prefilled again: its engine's steps count the prefilled tokens, and /metrics
its tier's loads. The answer is the same text."""

from __future__ import annotations

import re

import httpx

from tests.serve.harness import Running, server_config

LONG = "the quick brown fox jumps over the lazy dog, " * 6


def serve_and_ask(model_folder, tier_folder) -> tuple[str, int, int, str]:
    """One server's life: the long prompt once. Its answer, the prompt's tokens,
    the tokens its engine prefilled, and its /metrics text."""
    config = server_config(
        str(model_folder),
        allocator={"name": "paged", "block_size": 16, "prefix_caching": True},
        kv_tier={"name": "disk", "path": str(tier_folder)},
    )
    with Running(config) as server:
        body = {"prompt": LONG, "max_tokens": 6, "temperature": 0.0}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        prefilled = sum(step.prefill_tokens for step in server.engine.metrics.steps)
    return reply["choices"][0]["text"], reply["usage"]["prompt_tokens"], prefilled, metrics


def counter(metrics: str, name: str) -> float:
    match = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", metrics, re.MULTILINE)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


def test_a_restarted_server_loads_the_prefix_from_its_folder(model_folder, tmp_path):
    text, prompt_tokens, prefilled, metrics = serve_and_ask(model_folder, tmp_path)
    assert prompt_tokens > 3 * 16
    assert prefilled == prompt_tokens  # a cold folder: everything prefilled
    assert counter(metrics, "servelab_kv_tier_blocks_stored") >= prompt_tokens // 16

    again, prompt_again, prefilled_again, metrics_again = serve_and_ask(model_folder, tmp_path)
    assert again == text and prompt_again == prompt_tokens
    full_blocks = (prompt_tokens - 1) // 16  # the last token is always computed
    loaded = counter(metrics_again, "servelab_kv_tier_hit_tokens")
    assert loaded == 16 * full_blocks
    assert prefilled_again == prompt_tokens - loaded
    assert counter(metrics_again, "servelab_kv_tier_load_failures") == 0
