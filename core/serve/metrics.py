"""The server's Prometheus metrics, one registry per server (two servers in a process
never share figures): vLLM's names, types and `model_name` label, so a dashboard built
for vLLM reads them unchanged, beside servelab's own `servelab_*` names.

Engine state (queues, KV usage, preemptions, prefix-cache and KV-tier counters)
is read when /metrics is scraped, so it is current whether the engine stepped, aborted or idles.
Request figures are observed when a request finishes, from the engine's own request
record (queue, prefill, decode, TTFT, time per output token, end to end); inter-token
gaps are the server's, between a request's Deltas.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "cache_full": "abort",
            "error": "error", "rejected": "error"}  # fmt: skip


class _EngineState:
    """A collector that reads the engine when scraped."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine = None

    def collect(self):
        engine = self.engine
        if engine is None:
            return
        label = [self.model_name]
        scheduler = engine.scheduler
        queues = {k: len(getattr(scheduler, k, ())) for k in ("running", "waiting", "swapped")}
        usage = engine.allocator.usage()
        total = usage.get("blocks_total", 0)
        free = usage.get("blocks_free", total)
        stats = scheduler.stats() if hasattr(scheduler, "stats") else {}
        preempted = {k: stats.get(f"preemptions_{k}", 0) for k in ("recompute", "swap")}

        def gauge(name, doc, value, labels=("model_name",), values=label):
            family = GaugeMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(values), value)
            return family

        def counter(name, doc, value):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("vllm:num_requests_running", "requests running", queues["running"])
        yield gauge("vllm:num_requests_waiting", "requests waiting", queues["waiting"])
        yield gauge("vllm:num_requests_swapped", "requests swapped out", queues["swapped"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)",
                    (total - free) / total if total else 0.0)  # fmt: skip
        yield counter("vllm:num_preemptions", "preemptions", sum(preempted.values()))
        queried = usage.get("prefix_query_tokens", 0)
        hits = usage.get("prefix_hit_tokens", 0)
        yield counter("vllm:prefix_cache_queries", "prefix-cache queried tokens", queried)
        yield counter("vllm:prefix_cache_hits", "prefix-cache hit tokens", hits)
        if "spec_num_drafts" in stats:  # speculative decoding, as vLLM names its counts
            yield counter("vllm:spec_decode_num_drafts", "verifications of drafts",
                          stats["spec_num_drafts"])  # fmt: skip
            yield counter("vllm:spec_decode_num_draft_tokens", "draft tokens verified",
                          stats["spec_num_draft_tokens"])  # fmt: skip
            yield counter("vllm:spec_decode_num_accepted_tokens", "draft tokens accepted",
                          stats["spec_num_accepted_tokens"])  # fmt: skip
            family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "draft tokens accepted, by draft position",
                                         labels=["model_name", "position"])  # fmt: skip
            for key, value in stats.items():
                if key.startswith("spec_accepted_pos_"):
                    family.add_metric([self.model_name, key.rsplit("_", 1)[1]], value)
            yield family
        # servelab's own
        for key, value in queues.items():
            yield GaugeMetricFamily(f"servelab_requests_{key}", f"requests {key}", value=value)
        yield GaugeMetricFamily("servelab_kv_blocks_used", "KV blocks in use", value=total - free)
        yield GaugeMetricFamily("servelab_kv_blocks_free", "KV blocks free", value=free)
        yield GaugeMetricFamily("servelab_prefix_cache_hit_rate",
                                "prefix-cache hit tokens / query tokens",
                                value=hits / queried if queried else 0.0)  # fmt: skip
        family = CounterMetricFamily("servelab_preemptions", "preemptions, by kind",
                                     labels=["kind"])  # fmt: skip
        for kind, value in preempted.items():
            family.add_metric([kind], value)
        yield family
        if engine.kv_tier is not None:  # a KV tier below the device cache
            yield from _tier_families(engine)
        if engine.grammar_queue is not None:  # structured outputs, once a request had one
            grammars = engine.grammar_queue.stats()
            for key, doc in (("grammar_compiles", "grammars compiled"),
                             ("grammar_cache_hits", "grammars found compiled or compiling"),
                             ("grammar_compile_failures", "grammar compiles that raised"),
                             ("grammar_compile_s", "seconds spent compiling grammars")):  # fmt: skip
                name = "servelab_" + (key + "econds" if key.endswith("_s") else key)
                yield CounterMetricFamily(name, doc, value=grammars[key])
            yield CounterMetricFamily("servelab_grammar_mask_seconds",
                                      "seconds spent filling and applying token masks",
                                      value=engine.metrics.grammar_mask_seconds)  # fmt: skip
            yield GaugeMetricFamily("servelab_grammar_waiting", "requests waiting on a compile",
                                    value=grammars["grammar_waiting"])  # fmt: skip


# a KV tier's counts (`servelab.contracts.kv_tier.TierFigures`): name -> what it counts
_TIER_COUNTS = {
    "hits": "blocks a lookup found below the device cache and loaded",
    "misses": "blocks a lookup found neither on the device nor in the tier",
    "hit_tokens": "tokens loaded from the tier instead of prefilled again",
    "blocks_stored": "blocks copied into the tier",
    "blocks_dropped": "blocks offered to the tier and not kept",
    "blocks_evicted": "blocks the tier let go to make room",
    "load_failures": "tier entries found damaged on load (their blocks recomputed)",
    "bytes_loaded": "bytes loaded from the tier",
    "bytes_stored": "bytes copied into the tier",
}


def _tier_families(engine):
    """servelab_kv_tier_*: the tier's counts, its load time, and what it holds."""
    counts = engine.kv_tier.figures.as_dict()
    for key, doc in _TIER_COUNTS.items():
        yield CounterMetricFamily(f"servelab_kv_tier_{key}", doc, value=counts[key])
    seconds = counts["read_seconds"] + engine.executor.tier_load_seconds
    yield CounterMetricFamily("servelab_kv_tier_load_seconds",
                              "seconds spent loading blocks from the tier", value=seconds)  # fmt: skip
    yield CounterMetricFamily("servelab_kv_tier_store_seconds",
                              "seconds spent copying blocks into the tier",
                              value=engine.executor.tier_store_seconds)  # fmt: skip
    for key, value in engine.kv_tier.stats().items():
        if key not in counts:  # what it holds now, e.g. host_blocks, disk_blocks
            yield GaugeMetricFamily(f"servelab_kv_tier_{key}", f"the tier's {key}", value=value)


class ServerMetrics:
    def __init__(self, model_name: str = "model") -> None:
        self.registry = r = CollectorRegistry()
        self.state = _EngineState(model_name)
        r.register(self.state)
        m = ["model_name"]
        self.label = model_name

        def histogram(name, doc, buckets=_LATENCY):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "time to first token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "time between tokens")
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "per request: mean time per output token after the first")  # fmt: skip
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "end-to-end request latency")
        self.queue = histogram("vllm:request_queue_time_seconds", "time waiting before running")
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "first scheduled to first token")  # fmt: skip
        self.decode = histogram("vllm:request_decode_time_seconds", "first token to finished")
        self.prompt_len = histogram("vllm:request_prompt_tokens", "prompt tokens per request",
                                    _TOKENS)  # fmt: skip
        self.output_len = histogram("vllm:request_generation_tokens",
                                    "generated tokens per request", _TOKENS)  # fmt: skip
        self.tokens_in = Counter("vllm:prompt_tokens", "prompt tokens", m, registry=r).labels(
            model_name
        )
        self.tokens_out = Counter("vllm:generation_tokens", "generated tokens", m,
                                  registry=r).labels(model_name)  # fmt: skip
        self.success = Counter("vllm:request_success", "finished requests, by reason",
                               ["model_name", "finished_reason"], registry=r)  # fmt: skip
        self.finished = Counter("servelab_requests_finished", "finished requests, by engine reason",
                                ["reason"], registry=r)  # fmt: skip
        self._times: dict[str, list[float]] = {}

    def bind(self, engine) -> None:
        self.state.engine = engine

    def request_done(self, row: dict) -> None:
        """Observes one finished request's engine record (on the engine's thread)."""
        reason = str(row.get("finish_reason"))
        self.finished.labels(reason).inc()
        self.success.labels(self.label, _REASONS.get(reason, reason)).inc()
        self.tokens_in.inc(row.get("prompt_tokens") or 0)
        self.tokens_out.inc(row.get("output_tokens") or 0)
        self.prompt_len.observe(row.get("prompt_tokens") or 0)
        self.output_len.observe(row.get("output_tokens") or 0)
        first, scheduled = row.get("first_token_time"), row.get("first_scheduled_time")
        done = row.get("finished_time")
        figures = [(self.ttft, row.get("ttft")), (self.e2e, row.get("e2e")),
                   (self.queue, row.get("queue_time")), (self.tpot, row.get("tpot")),
                   (self.prefill, None if first is None or scheduled is None else first - scheduled),
                   (self.decode, None if first is None or done is None else done - first)]  # fmt: skip
        for histogram, value in figures:
            if value is not None and value == value:  # not NaN
                histogram.observe(value)

    def observe(self, item) -> None:
        """One (prompt index, Delta) a response handled: the gaps between a request's Deltas."""
        delta = item[1]
        now = time.perf_counter()
        times = self._times.setdefault(delta.request_id, [])
        if times:
            self.itl.observe(now - times[-1])
        times.append(now)
        if delta.finished:
            self._times.pop(delta.request_id, None)

    def discard_timings(self, request_ids) -> None:
        """Drops the inter-token timing kept for these requests: their stream closed."""
        for request_id in request_ids:
            self._times.pop(request_id, None)

    def text(self) -> bytes:
        return generate_latest(self.registry)
