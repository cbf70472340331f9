"""The `tensorrt_llm` model's custom metrics: TensorRT-LLM's families and labels (so that its
dashboards carry over), read from the engine every `stats_check_period_ms`, plus Kiln's counters of
batched iterations and a time-to-first-token histogram (Triton 2.51 has none for decoupled models)."""
import triton_python_backend_utils as pb_utils

from kiln.serve.metrics import TTFT_BUCKETS


def _buckets_1_5(limit: int) -> list[float]:
    """10, 50, 100, 500, ... up to limit (TensorRT-LLM's token-count buckets)."""
    out, scale = [], 10
    while scale <= limit:
        out += [b for b in (scale, 5 * scale) if b <= limit]
        scale *= 10
    return out


class EngineMetrics:
    def __init__(self, model: str, version: str, max_batch_size: int, tokens_per_block: int):
        common = {"model": model, "version": version}
        self.families = []  # a family must outlive its metrics

        def family(name, doc, kind=pb_utils.MetricFamily.GAUGE):
            self.families.append(pb_utils.MetricFamily(name=name, description=doc, kind=kind))
            return self.families[-1]

        def gauges(fam, label, values):
            return {v: fam.Metric(labels={label: v, **common}) for v in values}

        self.request = gauges(family("nv_trt_llm_request_metrics", "TRT LLM request metrics"), "request_type",
                              ("active", "max", "scheduled", "context", "waiting"))
        self.kv = gauges(family("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics"),
                         "kv_cache_block_type", ("max", "free", "used", "tokens_per", "reused", "fraction"))
        self.batcher = gauges(family("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight_batcher-specific "
                                     "metrics"), "inflight_batcher_specific_metric",
                              ("total_context_tokens", "generation_requests", "paused_requests"))
        self.general = gauges(family("nv_trt_llm_general_metrics", "General TRT LLM metrics"), "general_type",
                              ("timestamp", "iteration_counter"))
        iterations = family("kiln_iterations_total", "Engine steps: all, with more than one sequence in the batch, "
                            "and mixing prefill with generation (in-flight batching)", pb_utils.MetricFamily.COUNTER)
        self.iterations = {k: iterations.Metric(labels={"iteration_type": k, **common})
                           for k in ("all", "multi_request", "mixed")}
        self.counted = dict.fromkeys(self.iterations, 0)
        hist = pb_utils.MetricFamily.HISTOGRAM
        buckets = _buckets_1_5(10000)
        self.input_tokens = family("nv_llm_input_token_len", "TRT LLM response metrics", hist).Metric(
            labels={"response_metric_type": "total_input_tokens", **common}, buckets=buckets)
        self.output_tokens = family("nv_llm_output_token_len", "TRT LLM response metrics", hist).Metric(
            labels={"response_metric_type": "total_output_tokens", **common}, buckets=buckets)
        self.ttft = family("kiln_time_to_first_token_seconds", "From arrival at the engine to the first token",
                           hist).Metric(labels=common, buckets=TTFT_BUCKETS)
        self.request["max"].set(max_batch_size)
        self.kv["tokens_per"].set(tokens_per_block)
        self.tokens_per_block = tokens_per_block

    def update(self, s: dict, now: float) -> None:
        """From AsyncLLM.stats() (LLMEngine.get_stats)."""
        active = s["num_requests_running"] + s["num_requests_waiting"]
        last = s if active else dict.fromkeys(s, 0)  # the last step's batch, while there is one
        self.request["active"].set(active)
        self.request["scheduled"].set(last["num_scheduled_requests"])
        self.request["context"].set(last["num_context_requests"])
        self.request["waiting"].set(s["num_requests_waiting"])
        used = s["num_kv_blocks"] - s["num_free_kv_blocks"]
        self.kv["max"].set(s["num_kv_blocks"])
        self.kv["free"].set(s["num_free_kv_blocks"])
        self.kv["used"].set(used)
        # TensorRT-LLM's reusedBlocks: blocks taken from the prefix cache since the start (a gauge
        # there too); the engine counts hits in tokens, always whole blocks
        self.kv["reused"].set(s["prefix_cache_hits"] // self.tokens_per_block)
        self.kv["fraction"].set(used / s["num_kv_blocks"] if s["num_kv_blocks"] else 0.0)
        self.batcher["total_context_tokens"].set(last["num_context_tokens"])
        self.batcher["generation_requests"].set(last["num_generation_requests"])
        self.batcher["paused_requests"].set(s["num_paused_requests"])
        self.general["timestamp"].set(int(now))
        self.general["iteration_counter"].set(s["num_iterations"])
        for key, total in (("all", s["num_iterations"]), ("multi_request", s["num_multi_request_iterations"]),
                           ("mixed", s["num_mixed_iterations"])):
            if total > self.counted[key]:
                self.iterations[key].increment(total - self.counted[key])
                self.counted[key] = total

    def finished(self, prompt_tokens: int, output_tokens: int, ttft: float | None) -> None:
        self.input_tokens.observe(prompt_tokens)
        self.output_tokens.observe(output_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
