"""A `tensorrt_llm` model written for TensorRT-LLM's own C++ backend (`backend: "tensorrtllm"`), served
unchanged: `kiln triton-serve` registers Kiln as a Python-based backend of that name (server.py), and
this module reads such a config as tensorrtllm_backend does. Its parameters go by TensorRT-LLM's
names, old and new; a key left empty or as an unfilled `${...}` placeholder is unset, as in
TensorRT-LLM's model; keys for GPU features Kiln's CPU engines have no use for are accepted and said in
one line of the server log, those naming a feature Kiln lacks fail the load, naming it. Its inputs and
outputs may be left out: `complete_io` declares the ones Kiln's repository declares."""
from pathlib import Path

from kiln.triton_backend.parameters import PARAMETERS, PLACEHOLDER, ParamError, parse

BACKEND = "tensorrtllm"
TEMPLATE = Path(__file__).parent / "templates" / "inflight_batcher_llm" / "tensorrt_llm"
# Older names, and those hand-written configs use, of the keys Kiln reads.
ALIASES = {"engine_dir": "gpt_model_path", "batching_type": "gpt_model_type", "batching_strategy": "gpt_model_type"}
VALUE_ALIASES = {("gpt_model_type", "inflight"): "inflight_fused_batching",
                 ("batch_scheduler_policy", "guaranteed_completion"): "guaranteed_no_evict"}
GPU_ONLY = ("gpu_device_ids", "participant_ids", "gpu_weights_percent", "enable_context_fmha_fp32_acc",
            "multi_block_mode", "cuda_graph_mode", "cuda_graph_cache_size", "enable_trt_overlap",
            "kv_cache_host_memory_bytes", "kv_cache_onboard_blocks", "cross_kv_cache_fraction", "executor_worker_path",
            "speculative_decoding_fast_logits", "num_nodes", "recv_poll_period_ms", "FORCE_CPU_ONLY_INPUT_TENSORS",
            "lora_cache_optimal_adapter_size", "lora_cache_max_adapter_size", "lora_cache_gpu_memory_fraction",
            "lora_cache_host_memory_bytes", "iter_stats_max_iterations", "request_stats_max_iterations",
            "xgrammar_tokenizer_info_path", "max_num_sequences", "max_queue_size", "encoder_input_features_data_type",
            "logits_datatype")
# key -> (the values that leave the feature off, the feature)
REFUSED = {
    "worker_path": ((), "worker_path (no longer supported by TensorRT-LLM either; executor_worker_path replaced it)"),
    "encoder_model_path": ((), "encoder-decoder engines"),
    "max_attention_window_size": ((), "a run-time attention window (Kiln's windows are the model's own)"),
    "max_kv_cache_length": ((), "a run-time attention window (Kiln's windows are the model's own)"),
    "sink_token_length": (("0",), "attention sink tokens"),
    "medusa_choices": ((), "Medusa decoding"),
    "eagle_choices": ((), "EAGLE decoding"),
    "lookahead_window_size": ((), "lookahead decoding"),
    "lookahead_ngram_size": ((), "lookahead decoding"),
    "lookahead_verification_set_size": ((), "lookahead decoding"),
    "lora_prefetch_dir": ((), "prefetching LoRA adapters from a dir (send lora_weights with a task's first request)"),
    "normalize_log_probs": (("true", "1"), "unnormalized log probabilities"),
    "guided_decoding_backend": (("xgrammar",), "guided decoding backends other than xgrammar"),
}


def _unset(value) -> bool:
    text = value.strip() if isinstance(value, str) else value
    return text in (None, "") or (isinstance(text, str) and text.startswith("${") and text.endswith("}"))


def read_parameters(model_parameters: dict, names: list[str]) -> tuple[dict, list[str]]:
    """(Kiln's parameters `names`, typed as parameters.read types them; a line per key accepted without
    effect). ParamError names a key asking for a feature Kiln lacks or a bad value."""
    values, notes = {}, []
    for key, entry in model_parameters.items():
        value = entry.get("string_value", "") if isinstance(entry, dict) else entry
        if _unset(value):
            continue
        value = value.strip()
        name = ALIASES.get(key, key)
        if name in names:
            if name in values and values[name] != value:
                raise ParamError(f"parameters {key} and {name} disagree ({value!r}, {values[name]!r})")
            values[name] = VALUE_ALIASES.get((name, value), VALUE_ALIASES.get((name, value.lower()), value))
        elif key in REFUSED:
            off, feature = REFUSED[key]
            if value.lower() not in off:
                raise ParamError(f"parameter {key} {value!r}: {feature} is not supported by Kiln")
        elif key in GPU_ONLY:
            notes.append(f"parameter {key}: a TensorRT-LLM GPU setting, without effect on Kiln's CPU engines")
        else:
            notes.append(f"parameter {key}: not a tensorrt_llm parameter Kiln knows; ignored, as TensorRT-LLM "
                         f"ignores unknown keys")
    if "gpt_model_path" not in values:
        raise ParamError("parameter gpt_model_path (the engine dir) is missing from config.pbtxt")
    return {name: parse(name, values.get(name, PARAMETERS[name].default)) for name in names}, notes


def complete_io(auto_complete_model_config):
    """Triton's auto-complete: the inputs and outputs of Kiln's `tensorrt_llm` that the config does
    not declare, declared as there (a scalar then arrives as [batch, 1], which the model reads too)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text = PLACEHOLDER.sub("1", (TEMPLATE / "config.pbtxt").read_text())
    ours = text_format.Parse(text, model_config_pb2.ModelConfig())
    config = auto_complete_model_config.as_dict()
    declared_in = {t["name"] for t in config.get("input", [])}
    declared_out = {t["name"] for t in config.get("output", [])}
    for t in ours.input:
        if t.name not in declared_in:
            auto_complete_model_config.add_input({"name": t.name, "data_type": model_config_pb2.DataType.Name(
                t.data_type), "dims": list(t.dims), "optional": t.optional})
    for t in ours.output:
        if t.name not in declared_out:
            auto_complete_model_config.add_output({"name": t.name, "data_type": model_config_pb2.DataType.Name(
                t.data_type), "dims": list(t.dims)})
    return auto_complete_model_config


def backend_model() -> str:
    """The backend's model.py: the tensorrt_llm model of Kiln's repository."""
    return (TEMPLATE / "1" / "model.py").read_text()
