"""Prometheus metrics under vLLM's names (`vllm:`), Kiln's (`kiln:`, the same series), or both (the
default: dashboards, autoscalers and routers written for vLLM read a Kiln server unchanged, and those
written for Kiln keep working); `kiln serve --metrics-names` chooses. With vLLM's names come the older
ones its dashboards still query: `vllm:gpu_cache_usage_perc` (now `kv_cache_usage_perc`) and the
average prompt and generation throughputs in tokens/s, over the last 5 s or more.

Gauges and the preemption counter are read from the engine when Prometheus scrapes (one snapshot,
between two engine steps); token counters, request outcomes and latency histograms are updated by
the server as each request's outputs stream through it. Every count is per request (one per prompt,
whatever its `n`); an aborted request (client gone, shutdown) counts as `finished_reason="abort"`.
"""
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.runtime.outputs import RequestOutput

PREFIX = "kiln:"
VLLM_PREFIX = "vllm:"
METRIC_NAME_SETS = ("both", "vllm", "kiln")
# vLLM's older names for series it has renamed, and the throughputs its V0 engine logged.
VLLM_LEGACY = ("gpu_cache_usage_perc", "avg_prompt_throughput_toks_per_s", "avg_generation_throughput_toks_per_s")
THROUGHPUT_WINDOW = 5.0  # seconds: the averages span at least this much (vLLM's logging interval)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# Every family this module exports (as Prometheus exposes them: counters with `_total`), for the
# deploy manifests' test and for dashboards.
METRIC_NAMES = [f"{PREFIX}{n}" for n in (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_free_blocks",
    "kv_cache_total_blocks", "num_preemptions_total", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total", "request_success_total",
    "time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds")]
# The same under vLLM's names, and its older ones.
VLLM_METRIC_NAMES = [VLLM_PREFIX + n[len(PREFIX):] for n in METRIC_NAMES] + [VLLM_PREFIX + n for n in VLLM_LEGACY]


class EngineCollector(Collector):
    """Reads the engine's state at scrape time (`stats()` -> LLMEngine.get_stats's dict, or None
    while the engine is loading: then nothing engine-side is exported)."""

    def __init__(self, model_name: str, stats: Callable[[], dict | None]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()
        if s is None:
            return
        labels = ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric([self.model_name], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric([self.model_name], value)
            return c

        yield gauge("num_requests_running", "Requests with a sample in the running batch.",
                    s["num_requests_running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (new or preempted).",
                    s["num_requests_waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                    s["kv_cache_usage"])
        yield gauge("kv_cache_free_blocks", "KV cache blocks free.", s["num_free_kv_blocks"])
        yield gauge("kv_cache_total_blocks", "KV cache blocks in the pool.", s["num_kv_blocks"])
        yield counter("num_preemptions", "Sequences preempted (KV freed, recomputed later).",
                      s["num_preemptions"])
        yield counter("prefix_cache_queries", "Prefix cache queries, in tokens (of each admitted prompt).",
                      s["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Prefix cache hits, in tokens (found cached, not computed).",
                      s["prefix_cache_hits"])
        if s.get("max_loras") is not None:  # a LoRA engine
            yield gauge("lora_adapters_loaded", "LoRA adapters in the engine's slots.", s["lora_loaded"])
            yield gauge("lora_adapters_active", "LoRA adapters of running requests.", s["lora_active"])
            yield gauge("max_loras", "LoRA adapter slots of the engine.", s["max_loras"])
        spec = s.get("spec")
        if spec is not None:  # speculative decoding is on
            yield counter("spec_decode_num_drafts", "Draft proposals verified (one per sequence and step).",
                          spec["num_drafts"])
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec["num_draft_tokens"])
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens the target model accepted.",
                          spec["num_accepted_tokens"])
            c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by their position in the proposal.",
                                    labels=labels + ["position"])
            for pos, n in enumerate(spec["accepted_per_pos"]):
                c.add_metric([self.model_name, str(pos)], n)
            yield c


class Renamed(Collector):
    """`source`'s kiln: families under vLLM's prefix, and vLLM's older names (VLLM_LEGACY)."""

    def __init__(self, source: CollectorRegistry, legacy: Callable[[], list]):
        self.source, self.legacy = source, legacy

    def collect(self):
        for family in self.source.collect():
            if family.name.startswith(PREFIX):
                renamed = Metric(VLLM_PREFIX + family.name[len(PREFIX):], family.documentation, family.type,
                                 family.unit)
                renamed.samples = [s._replace(name=VLLM_PREFIX + s.name[len(PREFIX):]) for s in family.samples]
                yield renamed
        yield from self.legacy()


class Forward(Collector):
    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self):
        yield from self.source.collect()


class ServerMetrics:
    """`registry` is what /metrics exposes: `names` is "both", "vllm" or "kiln" (METRIC_NAME_SETS)."""

    def __init__(self, model_name: str, stats: Callable[[], dict | None], names: str = "both"):
        if names not in METRIC_NAME_SETS:
            raise ValueError(f"metrics names {names!r}: expected one of {', '.join(METRIC_NAME_SETS)}")
        self.model_name, self.stats = model_name, stats
        self.totals = {"prompt": 0, "generation": 0}
        self._samples: list[tuple[float, int, int]] = []  # (time, prompt, generation) at past scrapes
        self.registry = CollectorRegistry(auto_describe=True)
        for c in (ProcessCollector, PlatformCollector, GCCollector):
            c(registry=self.registry)
        self.own = r = CollectorRegistry(auto_describe=True)  # the kiln: families
        if names in ("both", "kiln"):
            self.registry.register(Forward(r))
        if names in ("both", "vllm"):
            self.registry.register(Renamed(r, self._legacy))
        r.register(EngineCollector(model_name, stats))
        labels = ["model_name"]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated (all samples).",
                                         labels, registry=r).labels(model_name)
        self.request_success = Counter(
            PREFIX + "request_success", "Requests finished, by the finish reason of their first sample "
            "(stop, length, abort).", labels + ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "From arrival at the engine to the first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", labels,
                              buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "From arrival at the engine to the last token.", labels,
                             buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "From arrival at the engine to first being scheduled.", labels,
                                    buckets=LATENCY_BUCKETS, registry=r).labels(model_name)

    async def track(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Pass one request's outputs through, counting its tokens and recording how it ended."""
        generated = 0
        prompt_counted = finished = False
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    total = sum(len(c.token_ids) for c in out.outputs)
                    if total > generated:
                        if not prompt_counted:  # prefill is done once a token exists
                            self.prompt_tokens.inc(len(out.prompt_token_ids))
                            self.totals["prompt"] += len(out.prompt_token_ids)
                            prompt_counted = True
                        self.generation_tokens.inc(total - generated)
                        self.totals["generation"] += total - generated
                        generated = total
                    if out.finished:
                        finished = True
                        self._finished(out)
                    yield out
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: the engine aborted it
            if not finished:
                self.request_success.labels(self.model_name, "abort").inc()
            raise

    def _legacy(self) -> list:
        """vLLM's older names: the KV cache usage gauge, and the token throughputs averaged since the
        newest past scrape at least THROUGHPUT_WINDOW ago (the oldest one kept, at first)."""
        now = time.monotonic()
        prompt, generation = self.totals["prompt"], self.totals["generation"]
        self._samples = [x for x in self._samples if now - x[0] < 60] + [(now, prompt, generation)]
        then = next((x for x in reversed(self._samples) if now - x[0] >= THROUGHPUT_WINDOW), self._samples[0])
        span = now - then[0]
        out = []
        for name, doc, value in (
                ("avg_prompt_throughput_toks_per_s", "Prompt tokens prefilled per second (vLLM's older name).",
                 (prompt - then[1]) / span if span > 0 else 0.0),
                ("avg_generation_throughput_toks_per_s", "Tokens generated per second (vLLM's older name).",
                 (generation - then[2]) / span if span > 0 else 0.0)):
            g = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            out.append(g)
        s = self.stats()
        if s is not None:
            g = GaugeMetricFamily(VLLM_PREFIX + "gpu_cache_usage_perc", "KV cache usage, 1 = full (vLLM's older "
                                  "name for kv_cache_usage_perc).", labels=["model_name"])
            g.add_metric([self.model_name], s["kv_cache_usage"])
            out.append(g)
        return out

    def _finished(self, out: RequestOutput) -> None:
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        self.request_success.labels(self.model_name, reason or "abort").inc()
        m = out.metrics
        if m is None or reason == "abort":
            return
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        if m.time_per_output_token is not None:
            self.tpot.observe(m.time_per_output_token)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
