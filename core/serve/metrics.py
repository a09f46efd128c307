"""The server's Prometheus metrics, one registry per server (so two servers in a
process never share figures). Gauges are refreshed on the engine thread after
each step; request histograms are observed when a request finishes, from the
engine's own request record (TTFT, inter-token gaps, end-to-end)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("servelab_requests_running", "requests running", registry=r)
        self.waiting = Gauge("servelab_requests_waiting", "requests waiting", registry=r)
        self.swapped = Gauge("servelab_requests_swapped", "requests swapped out", registry=r)
        self.blocks_used = Gauge("servelab_kv_blocks_used", "KV blocks in use", registry=r)
        self.blocks_free = Gauge("servelab_kv_blocks_free", "KV blocks free", registry=r)
        self.prefix_hit_rate = Gauge(
            "servelab_prefix_cache_hit_rate", "prefix-cache hit tokens / query tokens", registry=r
        )
        self.preemptions = Gauge(
            "servelab_preemptions", "preemptions so far, by kind", ["kind"], registry=r
        )
        self.ttft = Histogram("servelab_ttft_seconds", "time to first token", buckets=_LATENCY,
                              registry=r)  # fmt: skip
        self.itl = Histogram("servelab_itl_seconds", "inter-token latency", buckets=_LATENCY,
                             registry=r)  # fmt: skip
        self.e2e = Histogram("servelab_e2e_seconds", "end-to-end latency", buckets=_LATENCY,
                             registry=r)  # fmt: skip
        self.tokens_in = Counter("servelab_prompt_tokens", "prompt tokens", registry=r)
        self.tokens_out = Counter("servelab_generation_tokens", "generated tokens", registry=r)
        self.finished = Counter("servelab_requests_finished", "finished requests",
                                ["reason"], registry=r)  # fmt: skip

    def after_step(self, engine) -> None:
        """Refreshes the gauges from the engine's scheduler and allocator."""
        scheduler = engine.scheduler
        for gauge, queue in ((self.running, "running"), (self.waiting, "waiting"),
                             (self.swapped, "swapped")):  # fmt: skip
            gauge.set(len(getattr(scheduler, queue, ())))
        usage = engine.allocator.usage()
        if "blocks_total" in usage:
            self.blocks_used.set(usage["blocks_total"] - usage["blocks_free"])
            self.blocks_free.set(usage["blocks_free"])
        queried = usage.get("prefix_query_tokens", 0)
        self.prefix_hit_rate.set(usage.get("prefix_hit_tokens", 0) / queried if queried else 0.0)
        stats = scheduler.stats() if hasattr(scheduler, "stats") else {}
        for kind in ("recompute", "swap"):
            self.preemptions.labels(kind).set(stats.get(f"preemptions_{kind}", 0))

    def request_done(self, row: dict) -> None:
        """Observes one finished request's engine record."""
        self.finished.labels(str(row.get("finish_reason"))).inc()
        self.tokens_in.inc(row.get("prompt_tokens") or 0)
        self.tokens_out.inc(row.get("output_tokens") or 0)
        for histogram, key in ((self.ttft, "ttft"), (self.e2e, "e2e")):
            value = row.get(key)
            if value is not None and value == value:  # not NaN
                histogram.observe(value)

    def token_gaps(self, times: list[float]) -> None:
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)

    def text(self) -> bytes:
        return generate_latest(self.registry)
