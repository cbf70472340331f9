"""trtllm-build's options under their own names, values and meaning (TensorRT-LLM's
`tensorrt_llm/commands/build.py` and `PluginConfig`), so that its users' command lines run as
written. Each option maps onto a Kiln build setting; one whose switch Kiln does not have because
the CPU build always does it (or never needs it) is accepted and said in one line; one asking for a
feature Kiln lacks is a one-line ConfigError naming the feature. Kiln's own options keep working."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import click

from kiln.config import ConfigError

ENABLE = ("enable", "disable")
# PluginConfig's values for a plugin of a dtype: auto (the checkpoint's) or a dtype turn it on, disable
# turns it off; gemm_plugin also takes fp8 (and nvfp4, which Kiln lacks).
PLUGIN_DTYPES = ("auto", "float16", "float32", "bfloat16", "int32")
LOG_LEVELS = ("internal_error", "error", "warning", "info", "verbose", "debug", "trace")
# The values Kiln's plugin options take besides TensorRT-LLM's: the C++ plugin, traced inline for the
# compiler, the kiln:: Python op (debugging), or the OpenAI Triton kernel (kiln/plugins/gpu).
KILN_PLUGIN_VALUES = ("cpp", "inline", "python", "triton")


def _note(text: str) -> Callable:
    def handle(name, value) -> str:
        return f"--{name} {value}: {text}"
    return handle


def _only(accepted, text: str, refused: str) -> Callable:
    """A feature switch Kiln always has one way: that value is noted, the other refused."""
    def handle(name, value) -> str:
        if value not in accepted:
            raise ConfigError(f"--{name} {value}: {refused}")
        return f"--{name} {value}: {text}"
    return handle


def _refuse(feature: str, allowed) -> Callable:
    """A feature Kiln lacks: refused unless the value leaves it off."""
    def handle(name, value) -> str:
        if value not in allowed:
            raise ConfigError(f"--{name} {value}: {feature} is not supported by Kiln")
        return f"--{name} {value}: nothing to turn off ({feature} is not in Kiln)"
    return handle


def _kv_cache(name, value) -> str:
    paged = {"paged_kv_cache": "enable", "kv_cache_type": "paged"}[name]
    if str(value).lower() != paged:
        raise ConfigError(f"--{name} {value}: only a paged KV cache is supported by Kiln (its attention reads "
                          f"KV pages in place); a contiguous or disabled KV cache is not")
    return f"--{name} {value}: Kiln's KV cache is always paged"


def _speculative(name, value) -> str:
    if value == "eagle":
        return (f"--{name} {value}: an engine built from a checkpoint with an EAGLE-3 draft (convert_checkpoint "
                f"--eagle_model_dir) returns the hidden states it reads; speculative_config chooses it at run time")
    if value != "draft_tokens_external":
        raise ConfigError(f"--speculative_decoding_mode {value}: {value} decoding is not supported by Kiln; its "
                          f"engines verify drafts from EAGLE-3 (eagle), a draft engine or prompt lookup "
                          f"(draft_tokens_external)")
    return (f"--{name} {value}: every Kiln engine verifies external drafts; the draft engine or prompt lookup "
            f"is chosen at run time (speculative_config)")


GPU_ONLY = "a GPU kernel option with no CPU counterpart; nothing to do"
# name -> (click type, handler). Options whose value selects a Kiln setting come first.
FLAGS: dict[str, tuple] = {
    "kv_cache_type": (click.Choice(["continuous", "paged", "disabled"], case_sensitive=False), _kv_cache),
    "paged_kv_cache": (click.Choice(ENABLE), _kv_cache),
    "lora_ckpt_source": (click.Choice(["hf", "nemo"]),
                         _only(("hf",), "adapters are Hugging Face PEFT dirs", "NeMo LoRA checkpoints are not "
                               "supported by Kiln; convert the adapter to a Hugging Face PEFT dir")),
    "speculative_decoding_mode": (click.Choice(["draft_tokens_external", "lookahead_decoding", "medusa",
                                                "explicit_draft_tokens", "eagle"]), _speculative),
    "max_draft_len": (int, _note("speculative steps are bounded by max_num_tokens at run time; no build bound")),
    "max_prompt_embedding_table_size": (int, _refuse("prompt tuning and multimodal input (a prompt embedding "
                                                     "table)", allowed=(0,))),
    "remove_input_padding": (click.Choice(ENABLE),
                             _note("Kiln's engines always take the step's tokens packed, without padding")),
    "context_fmha": (click.Choice(ENABLE), _note("context-phase attention always runs in one fused op (the "
                                                 "attention plugin, or the kernel traced inline)")),
    "use_paged_context_fmha": (click.Choice(ENABLE), _note("context-phase attention always reads the paged KV "
                                                           "cache: prefix reuse and chunked prefill are run-time "
                                                           "options (enable_prefix_caching, "
                                                           "enable_chunked_prefill)")),
    "use_fp8_context_fmha": (click.Choice(ENABLE), _note("attention reads an FP8 KV cache in place whenever the "
                                                         "checkpoint has one")),
    "multiple_profiles": (click.Choice(ENABLE), _note("one graph with dynamic shapes; the GEMM plugin's kernels "
                                                      "are timed per token-count bucket either way")),
    "use_fused_mlp": (click.Choice(ENABLE), _note("the gate and up projections are one GEMM (with SwiGLU fused "
                                                  "into it on the GEMM plugin) either way")),
    "streamingllm": (click.Choice(ENABLE), _refuse("StreamingLLM (attention sinks)", allowed=("disable",))),
    "dora_plugin": (click.Choice(ENABLE), _refuse("DoRA", allowed=("disable",))),
    "moe_plugin": (click.Choice([*PLUGIN_DTYPES, "disable"]),
                   _note("mixture-of-experts layers always run the fused kiln_cpp::moe op")),
    "nccl_plugin": (click.Choice([*PLUGIN_DTYPES, "disable"]),
                    _note("the checkpoint's mapping decides, as trtllm-build's does: kiln_cpp's collectives "
                          "where tp_size > 1")),
    "bert_attention_plugin": (click.Choice([*PLUGIN_DTYPES, "disable"]), _note("no BERT attention in a decoder")),
    "mamba_conv1d_plugin": (click.Choice([*PLUGIN_DTYPES, "disable"]), _note("no Mamba layers in this model")),
    "paged_state": (click.Choice(ENABLE), _note("no recurrent state in this model")),
    "gemm_swiglu_plugin": (click.Choice(["fp8", "disable"]), _note(GPU_ONLY)),
    "low_latency_gemm_plugin": (click.Choice(["fp8", "disable"]), _note(GPU_ONLY)),
    "low_latency_gemm_swiglu_plugin": (click.Choice(["fp8", "disable"]), _note(GPU_ONLY)),
    "gemm_allreduce_plugin": (click.Choice(["float16", "bfloat16", "disable"]), _note(GPU_ONLY)),
    "fp8_rowwise_gemm_plugin": (click.Choice([*PLUGIN_DTYPES, "disable"]), _note(GPU_ONLY)),
    "reduce_fusion": (click.Choice(ENABLE), _note(GPU_ONLY)),
    "user_buffer": (click.Choice(ENABLE), _note(GPU_ONLY)),
    "norm_quant_fusion": (click.Choice(ENABLE), _note(GPU_ONLY)),
    "pp_reduce_scatter": (click.Choice(ENABLE), _note(GPU_ONLY)),
    "fuse_fp4_quant": (click.Choice(ENABLE), _note(GPU_ONLY)),
    "bert_context_fmha_fp32_acc": (click.Choice(ENABLE), _note("no BERT attention in a decoder")),
    "opt_num_tokens": (int, _note("no optimization profile to tune: GEMM kernels are timed per token bucket")),
    "opt_batch_size": (int, _note("no optimization profile to tune: GEMM kernels are timed per token bucket")),
    "max_encoder_input_len": (int, _note("a decoder-only model has no encoder")),
    "logits_dtype": (click.Choice(["float16", "float32"]),
                     _only(("float32",), "Kiln's engines return float32 logits",
                           "Kiln's engines return float32 logits only")),
    "gather_context_logits": (bool, _note("no build flag needed: context logits are returned per request "
                                          "(SamplingParams prompt_logprobs, Triton's return_context_logits)")),
    "gather_generation_logits": (bool, _note("no build flag needed: generation logits are returned per request")),
    "gather_all_token_logits": (bool, _note("no build flag needed: logits are returned per request")),
    "profiling_verbosity": (click.Choice(["layer_names_only", "detailed", "none"]),
                            _note("no TensorRT profiler; --log_level verbose prints every GEMM tactic timed")),
    "strip_plan": (bool, _note("no TensorRT plan to strip")),
    "weight_sparsity": (bool, _note("no sparse GEMM kernels on CPU; weights are built dense")),
    "weight_streaming": (bool, _note("weights already live in host memory")),
    "fast_build": (bool, _note("nothing slower to skip beyond --no_tactic_timing")),
    "enable_debug_output": (bool, _note("no debug tensors; the eager backend runs the exported graph op by op")),
    "visualize_network": (str, _note("no TensorRT network to export; the eager backend's engine is the "
                                     "exported program (torch.export.load)")),
    "monitor_memory": (bool, _note("engine-build always reports each rank's peak RSS")),
    "auto_parallel": (int, _refuse("auto parallel planning (convert with --tp_size / --pp_size instead)",
                                   allowed=(1,))),
    "gpus_per_node": (int, _note("only used with --auto_parallel")),
    "cluster_key": (str, _note("only used with --auto_parallel")),
    "model_config": (str, _refuse("building from a config without weights (--model_config); pass "
                                  "--checkpoint_dir", allowed=())),
    "model_cls_file": (str, _refuse("custom model classes", allowed=())),
    "model_cls_name": (str, _refuse("custom model classes", allowed=())),
}
ALIASES = {"max_prompt_embedding_table_size": "max_multimodal_len"}


def click_options() -> list:
    """The options, hidden from --help (which lists Kiln's own and says these are taken)."""
    out = []
    for name, (kind, _) in FLAGS.items():
        names = [f"--{name}"] + ([f"--{ALIASES[name]}"] if name in ALIASES else [])
        if kind is bool:
            out.append(click.option(*names, is_flag=True, default=None, hidden=True))
        else:
            out.append(click.option(*names, type=kind, default=None, hidden=True))
    return out


def notes(given: dict) -> list[str]:
    """A line per option of FLAGS given (None: not given), saying what engine-build did with it;
    ConfigError for one asking for a feature Kiln lacks."""
    return [handle(name, given[name]) for name, (_, handle) in FLAGS.items() if given.get(name) is not None]


def read_build_config(path) -> dict:
    """trtllm-build's --build_config: a JSON of BuildConfig fields, plugin_config among them, read as
    options given on the command line (those given there win)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--build_config {path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--build_config {path}: expected a JSON object of build options")
    plugins = data.pop("plugin_config", None) or {}
    if not isinstance(plugins, dict):
        raise ConfigError(f"--build_config {path}: plugin_config must be an object")
    return {**data, **plugins}
