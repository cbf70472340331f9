"""The `llmapi` layout's rules, TensorRT-LLM's names (`all_models/llmapi`): its model.yaml, a request's
`text_input` / `sampling_param_*` inputs to one engine request, and outputs to response tensors.
Numpy only (no Triton imports), so that they are tested without a server.

model.yaml names the engine (`model`) and takes the LLM API's argument names where Kiln has them;
its `triton_config` holds Triton's. As TensorRT-LLM's llmapi model: `text_output` is the whole text
so far (streamed responses too), with the prompt's text first unless
`sampling_param_exclude_input_from_output` is true; `finish_reason`, `stop_reason` and
`cumulative_logprob` are strings ("None" until the sequence ends)."""
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.config import EngineConfig
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.triton_backend.engine_io import RequestError, guided_decoding, perf_metrics
from kiln.triton_backend.sampling import sampling_fields

DEFAULT_MAX_TOKENS = 32  # the LLM API's SamplingParams default
# model.yaml's keys (the LLM API's names) -> AsyncLLM's arguments
ENGINE_KEYS = {"max_batch_size": "max_batch_size", "max_num_tokens": "max_num_tokens",
               "enable_chunked_prefill": "enable_chunked_prefill"}
KV_CACHE_KEYS = {"free_gpu_memory_fraction": "kv_cache_free_mem_fraction",
                 "enable_block_reuse": "enable_prefix_caching", "max_tokens": "max_tokens_in_paged_kv_cache"}
POLICIES = {"GUARANTEED_NO_EVICT": "guaranteed_no_evict", "MAX_UTILIZATION": "max_utilization"}
TRITON_KEYS = ("max_batch_size", "decoupled", "cancellation_check_period_ms")
BACKENDS = (None, "kiln", "trt", "tensorrt")  # all mean: run the compiled engine `model` names
# TensorRT-LLM's inputs, and ignore_eos (a field of the LLM API's SamplingParams the layout leaves out:
# benchmarks need outputs of a fixed length)
SAMPLING = ("best_of", "temperature", "top_k", "top_p", "frequency_penalty", "presence_penalty", "max_tokens", "seed",
            "exclude_input_from_output", "return_perf_metrics", "stop", "ignore_eos")
OUTPUT_FLAGS = ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob")
FINISH_REASONS = {"abort": "cancelled"}  # Kiln's -> the LLM API's; "stop" and "length" are the same


class ModelYamlError(ValueError):
    pass


@dataclass
class LLMAPIConfig:
    engine_dir: Path
    tokenizer: str | None
    engine_args: dict
    max_batch_size: int  # Triton's (0: no batch dimension, as TensorRT-LLM's default)
    decoupled: bool
    cancellation_check_period_ms: int


def read_model_yaml(path) -> LLMAPIConfig:
    """ModelYamlError names the key that is wrong and what it takes."""
    import yaml

    path = Path(path)
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ModelYamlError(f"{path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelYamlError(f"{path}: expected a mapping of the LLM API's arguments, got {type(cfg).__name__}")

    def fail(message):
        raise ModelYamlError(f"{path}: {message}")

    cfg = dict(cfg)
    triton = cfg.pop("triton_config", None) or {}
    if not isinstance(triton, dict) or set(triton) - set(TRITON_KEYS):
        fail(f"triton_config takes {', '.join(TRITON_KEYS)}; got {triton!r}")
    if "model" not in cfg:
        fail("`model` (the engine dir written by engine-build) is required")
    engine_dir = (path.parent / str(cfg.pop("model"))).resolve()
    try:
        engine = EngineConfig.load(engine_dir)
    except Exception as e:  # noqa: BLE001 - reported as the key's problem
        fail(f"model {engine_dir}: {e}")
    backend = cfg.pop("backend", None)
    if backend not in BACKENDS:
        fail(f"backend {backend!r}: Kiln serves the compiled engine `model` names; leave backend out "
             f"(or one of {', '.join(b for b in BACKENDS if b)})")
    mapping = engine.pretrained_config.mapping
    for key, built in (("tensor_parallel_size", mapping.tp_size), ("pipeline_parallel_size", mapping.pp_size)):
        value = cfg.pop(key, built)
        if value != built:
            fail(f"{key} {value}: the engine was built for {built} (parallelism is fixed at convert time)")
    args = {}
    tokenizer = cfg.pop("tokenizer", None)
    for key, arg in ENGINE_KEYS.items():
        if key in cfg:
            args[arg] = cfg.pop(key)
    for section, keys in (("kv_cache_config", KV_CACHE_KEYS), ("scheduler_config", {"capacity_scheduler_policy": 0})):
        value = cfg.pop(section, None) or {}
        if not isinstance(value, dict) or set(value) - set(keys):
            fail(f"{section} takes {', '.join(keys)}; got {value!r}")
        for key, v in value.items():
            if section == "scheduler_config":
                if str(v).upper() not in POLICIES:
                    fail(f"scheduler_config.capacity_scheduler_policy {v!r}: expected {' or '.join(POLICIES)}")
                args["scheduler_policy"] = POLICIES[str(v).upper()]
            else:
                args[keys[key]] = v
    if cfg:
        known = ["model", "tokenizer", "backend", "tensor_parallel_size", "pipeline_parallel_size", *ENGINE_KEYS,
                 "kv_cache_config", "scheduler_config", "triton_config"]
        fail(f"unknown key(s) {', '.join(map(repr, cfg))}: the keys are {', '.join(known)}")
    max_batch_size, decoupled = triton.get("max_batch_size", 0), triton.get("decoupled", False)
    period = triton.get("cancellation_check_period_ms", 100)
    if not isinstance(max_batch_size, int) or max_batch_size < 0:
        fail(f"triton_config.max_batch_size must be an integer >= 0, got {max_batch_size!r}")
    if not isinstance(decoupled, bool):
        fail(f"triton_config.decoupled must be true or false, got {decoupled!r}")
    if not isinstance(period, int) or period < 1:
        fail(f"triton_config.cancellation_check_period_ms must be an integer >= 1, got {period!r}")
    return LLMAPIConfig(engine_dir, tokenizer, args, max_batch_size, decoupled, period)


@dataclass
class LLMAPIRequest:
    prompt: str
    params: SamplingParams
    streaming: bool
    exclude_input: bool
    perf_metrics: bool
    flags: dict  # OUTPUT_FLAGS -> bool


def _scalar(tensors: dict, name: str):
    value = tensors.get(name)
    if value is None:
        return None
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"{name} must be one value, got shape {list(np.shape(value))}")
    item = flat[0].item() if isinstance(flat[0], np.generic) else flat[0]  # a STRING input's element is bytes
    return item.decode("utf-8", errors="replace") if isinstance(item, bytes) else item


def parse_request(tensors: dict, decoupled: bool) -> LLMAPIRequest:
    """RequestError names the input that is wrong and what was expected."""
    text = tensors.get("text_input")
    if text is None:
        raise RequestError("text_input is required")
    text = np.asarray(text).reshape(-1)
    if text.size != 1:
        raise RequestError(f"text_input must hold one prompt (a batch is not supported), got {text.size}")
    prompt = text[0].decode("utf-8", errors="replace") if isinstance(text[0], bytes) else str(text[0])
    sp = {name: _scalar(tensors, f"sampling_param_{name}") for name in SAMPLING if name != "stop"}
    streaming = bool(_scalar(tensors, "streaming") or False)
    if streaming and not decoupled:
        raise RequestError("streaming needs the decoupled model (triton_config.decoupled: true in model.yaml)")
    if (sp["best_of"] or 1) != 1:
        raise RequestError(f"sampling_param_best_of {sp['best_of']} is not supported: there is no best-of sampling")
    stop = tensors.get("sampling_param_stop")
    stop = [] if stop is None else [s.decode("utf-8") if isinstance(s, bytes) else str(s)
                                    for s in np.asarray(stop).reshape(-1)]
    flags = {f: bool(_scalar(tensors, f) or False) for f in OUTPUT_FLAGS}
    max_tokens = DEFAULT_MAX_TOKENS if sp["max_tokens"] is None else sp["max_tokens"]
    if max_tokens < 1:
        raise RequestError(f"sampling_param_max_tokens must be >= 1, got {max_tokens}")
    try:
        params = SamplingParams(
            **sampling_fields(sp["top_k"], sp["top_p"], sp["temperature"]), max_tokens=max_tokens, seed=sp["seed"],
            presence_penalty=sp["presence_penalty"] or 0.0, frequency_penalty=sp["frequency_penalty"] or 0.0,
            stop=[s for s in stop if s], ignore_eos=bool(sp["ignore_eos"]),
            logprobs=0 if flags["return_cumulative_logprob"] else None,
            guided_decoding=guided_decoding(_scalar(tensors, "guided_decoding_guide_type"),
                                            _scalar(tensors, "guided_decoding_guide")))
    except ValueError as e:
        raise RequestError(f"sampling_param_{e}" if str(e).split(" ")[0] in SAMPLING else str(e)) from None
    return LLMAPIRequest(prompt, params, streaming, bool(sp["exclude_input_from_output"]),
                         bool(sp["return_perf_metrics"]), flags)


def response_tensors(request: LLMAPIRequest, out: RequestOutput, tokens_per_block: int) -> dict:
    c = out.outputs[0]
    text = c.text if request.exclude_input else (out.prompt or "") + c.text
    t = {"text_output": np.array([text.encode("utf-8")], object)}
    values = {"return_finish_reason": FINISH_REASONS.get(c.finish_reason, c.finish_reason),
              "return_stop_reason": c.stop_reason, "return_cumulative_logprob": c.cumulative_logprob}
    for flag, name in zip(OUTPUT_FLAGS, ("finish_reason", "stop_reason", "cumulative_logprob")):
        if request.flags[flag]:
            t[name] = np.array([str(values[flag]).encode()], object)
    if request.perf_metrics:
        m = perf_metrics(out, c, tokens_per_block)
        total, reused = int(m["kv_cache_alloc_total_blocks"][0, 0]), int(m["kv_cache_reused_blocks"][0, 0])
        t.update({k: v.reshape(-1) for k, v in m.items()},
                 kv_cache_reused_block=np.array([reused], np.int32),
                 kv_cache_missed_block=np.array([total - reused], np.int32),
                 kv_cache_hit_rate=np.array([reused / max(total, 1)], np.float32))
        del t["kv_cache_reused_blocks"]
    return t
