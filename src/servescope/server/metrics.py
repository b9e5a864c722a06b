"""Prometheus metrics with vLLM's names under `servescope:`, one CollectorRegistry per app.

Two sources: request outputs (called on the engine thread: token counters, latency histograms at
finish) and the engine's KV/scheduler state, read on the engine thread when /metrics is scraped
(gauges, and the engine's cumulative counters turned into Counter increments). The only label is
model_name, a bounded set of one.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from servescope.engine.outputs import RequestOutput
from servescope.kernels.cpu import ops as cpu_ops

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        L = ["model_name"]

        def g(name, doc):
            return Gauge(f"servescope:{name}", doc, L, registry=r).labels(model_name)

        def c(name, doc):
            return Counter(f"servescope:{name}", doc, L, registry=r).labels(model_name)

        def h(name, doc, buckets):
            return Histogram(f"servescope:{name}", doc, L, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = g("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = g("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = g("kv_cache_usage_perc", "KV cache usage (referenced blocks / all blocks), 0..1.")
        self.prefix_cache_queries = c("prefix_cache_queries", "Prefix cache queries (engine total).")
        self.prefix_cache_hits = c("prefix_cache_hits", "Prefix cache hits (engine total).")
        self.num_preemptions = c("num_preemptions", "Preemptions (engine total).")
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = c("generation_tokens", "Generated tokens.")
        self.reasoning_tokens = c("reasoning_tokens",
                                  "Generated tokens inside reasoning blocks (reasoning parser).")
        self.ttft = h("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = h("time_per_output_token_seconds", "Time per output token after the first.", TPOT_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue_time = h("request_queue_time_seconds", "Time from arrival to first scheduling.", LATENCY_BUCKETS)
        # speculative decoding (vLLM's names): verifications with drafts, drafts scored, drafts accepted
        self.spec_decode_num_drafts = c("spec_decode_num_drafts",
                                        "Speculative verifications with drafts (engine total).")
        self.spec_decode_num_draft_tokens = c("spec_decode_num_draft_tokens", "Draft tokens verified (engine total).")
        self.spec_decode_num_accepted_tokens = c("spec_decode_num_accepted_tokens",
                                                 "Draft tokens accepted (engine total).")
        self._totals = (("prefix_cache_queries", self.prefix_cache_queries),
                        ("prefix_cache_hits", self.prefix_cache_hits), ("num_preemptions", self.num_preemptions),
                        ("spec_decode_num_drafts", self.spec_decode_num_drafts),
                        ("spec_decode_num_draft_tokens", self.spec_decode_num_draft_tokens),
                        ("spec_decode_num_accepted_tokens", self.spec_decode_num_accepted_tokens))
        # which CPU kernels serve (isa avx512 | avx2 | neon | scalar | eager; none: no CPU engine here)
        self.cpu_kernels = Info("servescope:cpu_kernels", "The CPU kernel path in use.", L,
                                registry=r).labels(model_name)
        self._last = {name: 0 for name, _ in self._totals}
        self._lock = threading.Lock()

    def on_output(self, out: RequestOutput, new_tokens: int) -> None:
        """Engine thread: one RequestOutput and how many output tokens it added."""
        if new_tokens > 0:
            self.generation_tokens.inc(new_tokens)
        if not out.finished:
            return
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        for o in out.outputs:
            m = o.metrics
            if m is None:
                continue
            for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e),
                                (self.queue_time, m.queue_time)):
                if value is not None and value >= 0:
                    hist.observe(value)

    def update_state(self, state: dict) -> None:
        """From engine.kv_cache_state(): gauges, and the engine's totals as counter increments."""
        self.num_requests_running.set(state.get("num_running", 0))
        self.num_requests_waiting.set(state.get("num_waiting", 0))
        self.kv_cache_usage_perc.set(state.get("usage", 0.0))
        with self._lock:
            for name, counter in self._totals:
                value = int(state.get(name, 0))
                if value > self._last[name]:
                    counter.inc(value - self._last[name])
                self._last[name] = max(value, self._last[name])

    def render(self) -> bytes:
        path = cpu_ops.loaded_kernel_path()
        self.cpu_kernels.info({"isa": cpu_ops.isa() if path else "none", "path": path or "none"})
        return generate_latest(self.registry)
