"""A Hugging Face config.json -> Kiln's (TensorRT-LLM's) checkpoint config, for transformers 4.x and 5.x.

transformers 4 writes `rope_theta` and `rope_scaling` (older files `torch_dtype`); transformers 5
writes `rope_parameters: {rope_theta, rope_type, ...}` and `dtype`. Both are read with HF's own
meaning. Nothing that changes what the model computes is assumed: every key below is either read,
or refused with a one-line error (key, value, what is supported) when its value is one Kiln does
not implement. A key that is absent takes the default HF itself uses for that model type (DEFAULTS).

Keys read (for the families in FAMILIES; "refused" names the values that are):

| key | meaning in the checkpoint config | refused |
|---|---|---|
| architectures, model_type | architecture (they must agree) | other families |
| text_config | a nested text model: its keys are read, the outer ones fill in | |
| vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size | sizes (required) | |
| num_key_value_heads, head_dim | KV heads, head_size | head_dim null (Qwen3, Qwen2-MoE, Qwen3-MoE) |
| max_position_embeddings | max_position_embeddings | |
| hidden_act | silu ("swish" is the same function) | anything else |
| rms_norm_eps | norm_epsilon | |
| rope_theta, rope_scaling (4.x); rope_parameters (5.x) | rotary_base, rotary_scaling: default, linear (factor), dynamic (factor), llama3 (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), yarn (factor, original_max_position_embeddings, attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, truncate), longrope (Phi-3: short_factor, long_factor; original_max_position_embeddings) | other rope types (proportional, su), unknown keys of a type, per-layer-type rope that differs between layers, the two schemas disagreeing |
| original_max_position_embeddings (top level) | transformers 5 prefers it for llama3/yarn; Phi-3's LongRoPE switch (absent: 4096) | a value transformers 4 would not use |
| partial_rotary_factor (top level or in the rope dict) | Phi-3: partial_rotary_factor (the first head_size * factor dims of q and k rotate) | anything but 1.0 elsewhere; the two places disagreeing |
| tie_word_embeddings | tie_word_embeddings | |
| attention_bias (Llama, Qwen3, Qwen3-MoE, Granite, OLMo 2, SmolLM3) | | true (a bias on o_proj too); Qwen2's q/k/v bias is implied by its architecture |
| qkv_bias (Qwen2-MoE) | attn_bias (biases on q/k/v, none on o_proj) | |
| mlp_bias (Llama, Granite, SmolLM3) | | true |
| embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling (Granite) | the same names: the embedding and each block's output multiplied, the attention scores scaled by attention_multiplier (HF's default 1.0, not head_dim ** -0.5), the logits divided | values that are not finite numbers, logits_scaling 0 |
| (OLMo 2's architecture) | pre_norm false, post_norm true (RMSNorm on each block's output before the residual add), qk_layernorm over the whole q and k projections | |
| hidden_activation, query_pre_attn_scalar, final_logit_softcapping, attn_logit_softcapping, use_bidirectional_attention (Gemma 2, Gemma 3 text); rope_local_base_freq, sliding_window_pattern (Gemma 3) | GeGLU (gelu_pytorch_tanh); attention_multiplier = query_pre_attn_scalar ** -0.5; the soft caps; RMSNorms by 1 + weight, the embedding by sqrt(hidden_size), sandwich norms; sliding layers every other one (Gemma 2) or all but every sliding_window_pattern-th (Gemma 3) when layer_types is absent; rotary_base_local for Gemma 3's sliding layers (transformers 5: rope_parameters.sliding_attention) | another activation, bidirectional attention, caps that are not positive numbers, a local rope that is not the default type |
| no_rope_layers, no_rope_layer_interval (SmolLM3) | nope_layers: the layers whose no_rope_layers entry is 0 attend without rotary embedding (absent: every no_rope_layer_interval-th) | a list that is not one 0 or 1 per layer |
| sliding_window (Mistral, Mixtral, Phi-3: every layer); use_sliding_window, max_window_layers, layer_types (Qwen2/Qwen3: the layers layer_types marks, else those from max_window_layers on); use_sliding_window (Qwen3-MoE: every layer); use_sliding_window, layer_types (SmolLM3: absent, its NoPE layers slide); Qwen2-MoE's | sliding_window, sliding_window_layers (null: every layer); none where the window is at least max_position_embeddings | Qwen2-MoE with a window shorter than max_position_embeddings (transformers 4 slides every layer, 5 the layer_types ones); layer_types marking a layer sliding without use_sliding_window (transformers 5 then slides a window of 0) |
| num_local_experts (Mixtral), num_experts (Qwen2-MoE, Qwen3-MoE); transformers 5 maps num_experts onto num_local_experts for Mixtral and Qwen3-MoE, so either name is read there | moe.num_experts | fewer than 1; both names present and different |
| num_experts_per_tok | moe.top_k | outside 1 .. the number of experts |
| norm_topk_prob (Qwen2-MoE, Qwen3-MoE; Mixtral always renormalizes) | moe.normalization_mode: 1 (top-k weights divided by their sum) if true, else 0 | |
| moe_intermediate_size (Qwen2-MoE, Qwen3-MoE; Mixtral's experts are intermediate_size wide) | moe_intermediate_size | below 1 |
| shared_expert_intermediate_size (Qwen2-MoE: a sigmoid-gated shared expert on every MoE layer) | moe.shared_expert_intermediate_size (0: none) | negative; on Mixtral/Qwen3-MoE (no shared expert) any value but 0 |
| decoder_sparse_step, mlp_only_layers (Qwen2-MoE, Qwen3-MoE) | decoder_sparse_step, mlp_only_layers: layer i is MoE unless mlp_only_layers names it or (i + 1) % decoder_sparse_step != 0; the others are dense MLPs intermediate_size wide | a step below 1; mlp_only_layers not a list of integers |
| dtype, torch_dtype | the default --dtype | dtypes other than float32/bfloat16/float16 |
| bos_token_id, eos_token_id | stop tokens | |
| quantization_config | | (read by kiln/convert/prequant, not here) |
| attn_logit_softcapping, final_logit_softcapping, logits_scaling, embedding_multiplier, residual_multiplier, attention_multiplier, query_pre_attn_scalar, use_mrope | (other families' math, where a family does not read them itself; HF's classes for it ignore them, so a config that sets them was not made for it) | any value but the neutral one |

IGNORED lists the keys that do not change the forward pass at inference (dropout, initialisation,
generation defaults, output switches, bookkeeping; for the MoE families router_aux_loss_coef,
output_router_logits and Mixtral's router_jitter_noise, which act only in training);
tests/test_hf_config.py walks every field of the installed transformers' LlamaConfig, MistralConfig,
Qwen2Config, Qwen3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig, GraniteConfig, Olmo2Config,
SmolLM3Config, Phi3Config, Gemma2Config and Gemma3TextConfig and fails on one that
is in neither table, so a field added by a new transformers release is a failing test, not a wrong
answer. Other keys a config.json carries (auto_map, unsloth_version ...) are not read by these
models in HF either, and are ignored.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kiln.config import DTYPES, SUPPORTED_ARCHITECTURES, ConfigError, Mapping, MoeConfig, PretrainedConfig
from kiln.convert.hf_rope import rope_of

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
            "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM"}
GEMMA = ("gemma2", "gemma3_text")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
ARCH_FAMILY = {arch: family for family, arch in FAMILIES.items()}

# What HF's config classes use when a key is absent (the same in transformers 4.57 and 5.x; tests
# hold these to the installed classes). None for head_dim / num_key_value_heads: derived from the
# sizes (hidden_size // num_attention_heads, num_attention_heads).
_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
               head_dim=None)
_QWEN = dict(_COMMON, num_key_value_heads=32, max_position_embeddings=32768, sliding_window=4096,
             use_sliding_window=False, max_window_layers=28)
DEFAULTS = {
    "llama": dict(_COMMON, num_key_value_heads=None, max_position_embeddings=2048, attention_bias=False,
                  mlp_bias=False),
    "mistral": dict(_COMMON, num_key_value_heads=8, max_position_embeddings=131072, sliding_window=4096),
    "qwen2": _QWEN,
    "qwen3": dict(_QWEN, head_dim=128, attention_bias=False),
    "mixtral": dict(_COMMON, rms_norm_eps=1e-5, rope_theta=1e6, num_key_value_heads=8,
                    max_position_embeddings=131072, sliding_window=None, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(_QWEN, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                      moe_intermediate_size=1408, shared_expert_intermediate_size=5632, decoder_sparse_step=1,
                      mlp_only_layers=[], qkv_bias=True),
    "qwen3_moe": dict(_COMMON, num_key_value_heads=4, max_position_embeddings=32768, sliding_window=4096,
                      use_sliding_window=False, attention_bias=False, num_experts=128, num_experts_per_tok=8,
                      norm_topk_prob=False, moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[]),
    "granite": dict(_COMMON, num_key_value_heads=None, max_position_embeddings=2048, attention_bias=False,
                    mlp_bias=False, embedding_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0,
                    attention_multiplier=1.0),
    "olmo2": dict(_COMMON, rms_norm_eps=1e-5, num_key_value_heads=None, max_position_embeddings=2048,
                  attention_bias=False),
    "smollm3": dict(_COMMON, rope_theta=2000000.0, tie_word_embeddings=True, num_key_value_heads=4,
                    max_position_embeddings=32768, attention_bias=False, mlp_bias=False, use_sliding_window=False,
                    sliding_window=None, no_rope_layers=None, no_rope_layer_interval=4),
    "phi3": dict(_COMMON, rms_norm_eps=1e-5, num_key_value_heads=None, max_position_embeddings=4096,
                 sliding_window=None),
    "gemma2": dict(_COMMON, hidden_activation="gelu_pytorch_tanh", head_dim=256, num_key_value_heads=4,
                   max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, use_bidirectional_attention=False),
    "gemma3_text": dict(_COMMON, hidden_activation="gelu_pytorch_tanh", head_dim=256, num_key_value_heads=4,
                        max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=1e6,
                        attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                        final_logit_softcapping=None, attn_logit_softcapping=None, rope_local_base_freq=10000.0,
                        use_bidirectional_attention=False, sliding_window_pattern=6),
}
# The experts' count: the name transformers 4 reads first; transformers 5's attribute_map also takes
# the second for Mixtral and Qwen3-MoE (num_experts -> num_local_experts).
EXPERTS_KEYS = {"mixtral": ("num_local_experts", "num_experts"), "qwen2_moe": ("num_experts",),
                "qwen3_moe": ("num_experts", "num_local_experts")}

_NOT_NULL = ("hidden_act", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "max_position_embeddings",
             "max_window_layers", "embedding_multiplier", "logits_scaling", "residual_multiplier",
             "attention_multiplier", "no_rope_layer_interval", "num_local_experts", "num_experts",
             "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step")
# HF builds q_proj from getattr(config, "head_dim", <derived>): an explicit null has no fallback.
_HEAD_DIM_NOT_NULL = ("qwen3", "qwen2_moe", "qwen3_moe")
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_MAPPED_ALL = {"architectures", "model_type", "text_config", *REQUIRED, "num_key_value_heads", "head_dim",
               "max_position_embeddings", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
               "rope_parameters", "original_max_position_embeddings", "partial_rotary_factor",
               "tie_word_embeddings", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
               "quantization_config"}
MAPPED = {
    "llama": _MAPPED_ALL | {"attention_bias", "mlp_bias"},
    "mistral": _MAPPED_ALL | {"sliding_window"},
    "qwen2": _MAPPED_ALL | {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"},
    "qwen3": _MAPPED_ALL | {"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers",
                            "layer_types"},
    "mixtral": _MAPPED_ALL | {"sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok"},
    "qwen2_moe": _MAPPED_ALL | {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
                                "num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size",
                                "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                                "qkv_bias"},
    "qwen3_moe": _MAPPED_ALL | {"attention_bias", "sliding_window", "use_sliding_window", "num_experts",
                                "num_local_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size",
                                "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size"},
    "granite": _MAPPED_ALL | {"attention_bias", "mlp_bias", "embedding_multiplier", "logits_scaling",
                              "residual_multiplier", "attention_multiplier"},
    "olmo2": _MAPPED_ALL | {"attention_bias"},
    "smollm3": _MAPPED_ALL | {"attention_bias", "mlp_bias", "use_sliding_window", "sliding_window", "layer_types",
                              "no_rope_layers", "no_rope_layer_interval"},
    "phi3": _MAPPED_ALL | {"sliding_window"},
    "gemma2": _MAPPED_ALL | {"hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window",
                             "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
                             "use_bidirectional_attention"},
    "gemma3_text": _MAPPED_ALL | {"hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window",
                                  "layer_types", "sliding_window_pattern", "final_logit_softcapping",
                                  "attn_logit_softcapping", "rope_local_base_freq", "use_bidirectional_attention"},
}
# Other families' math: refused unless absent or at the value that means "off".
FOREIGN = {"attn_logit_softcapping": None, "final_logit_softcapping": None, "logits_scaling": 1.0,
           "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": None,
           "query_pre_attn_scalar": None, "use_mrope": False}
# The same per family: Mixtral and Qwen3-MoE have no shared expert (HF ignores the key; a config that
# sets it was made for Qwen2-MoE's math).
FOREIGN_BY_FAMILY = {"mixtral": {"shared_expert_intermediate_size": 0},
                     "qwen3_moe": {"shared_expert_intermediate_size": 0}}

IGNORED = {
    # training only, or the same numbers another way
    "attention_dropout", "initializer_range", "pretraining_tp", "pad_token_id", "use_cache",
    "chunk_size_feed_forward", "pruned_heads", "torchscript", "tie_encoder_decoder", "use_bfloat16",
    "tf_legacy_loss",
    # what the forward returns, not what it computes
    "output_attentions", "output_hidden_states", "return_dict", "output_scores", "return_dict_in_generate",
    # generation defaults (Kiln's come with each request)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "decoder_start_token_id", "sep_token_id",
    # encoder-decoder and task heads, which these causal LMs do not have
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "id2label", "label2id", "problem_type", "finetuning_task",
    # bookkeeping
    "_name_or_path", "transformers_version", "tokenizer_class", "prefix", "task_specific_params",
}
# Per family: keys HF's class carries that its model code does not read.
_ROUTER_TRAINING = {"router_aux_loss_coef", "output_router_logits"}  # the load-balancing loss
IGNORED_BY_FAMILY = {"llama": set(), "mistral": set(), "qwen2": {"attention_bias"}, "qwen3": set(),
                     "mixtral": _ROUTER_TRAINING | {"router_jitter_noise"},  # noise only when training
                     "qwen2_moe": set(_ROUTER_TRAINING),
                     # Qwen3-MoE's config.json files carry max_window_layers; HF's Qwen3Moe does not read it
                     "qwen3_moe": _ROUTER_TRAINING | {"max_window_layers"},
                     "granite": set(), "olmo2": set(),
                     # SmolLM3-3B's config.json carries max_window_layers; HF's SmolLM3 does not read it
                     "smollm3": {"max_window_layers"},
                     # the pattern kept from sliding_window_pattern: layer_types, written beside it, is read
                     "gemma3_text": {"_sliding_window_pattern"}, "gemma2": set(),
                     "phi3": {"resid_pdrop", "embd_pdrop"}}  # dropouts

def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"model dir {model_dir} not found (expected a Hugging Face model directory)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found (expected a Hugging Face config.json)")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return hf


def pretrained_config_from_hf(
    hf: dict[str, Any],
    dtype: str | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    where: Path | str = "config.json",
    moe_tp_size: int | None = None,
    moe_ep_size: int | None = None,
) -> PretrainedConfig:
    """Map a Hugging Face config.json dict (either transformers major's layout) onto Kiln's config."""
    try:
        mapping = Mapping(world_size=tp_size * pp_size, tp_size=tp_size, pp_size=pp_size, moe_tp_size=moe_tp_size,
                          moe_ep_size=moe_ep_size)
        return _map(hf, dtype, mapping)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _map(hf: dict, dtype: str | None, mapping: Mapping) -> PretrainedConfig:
    hf, arch = _text_model(hf)
    family = ARCH_FAMILY[arch]
    missing = [k for k in REQUIRED if hf.get(k) is None]
    if missing:
        raise ConfigError(f"missing field(s): {', '.join(missing)}")
    defaults = DEFAULTS[family]

    def get(key):
        return hf[key] if key in hf else defaults[key]

    for key in _NOT_NULL:  # HF keeps an explicit null, and then cannot build the model
        if key in hf and hf[key] is None and key in defaults:
            raise ConfigError(f"{key} null is not supported; expected a value (absent, HF's default for "
                              f"{arch} is {defaults[key]!r})")

    foreign = {k: v for k, v in FOREIGN.items() if k not in MAPPED[family]}  # Granite reads its multipliers
    for key, neutral in {**foreign, **FOREIGN_BY_FAMILY.get(family, {})}.items():
        if hf.get(key, neutral) not in (None, neutral):
            raise ConfigError(f"{key}={hf[key]!r} is not supported for {arch} (HF's {arch} does not "
                              f"implement it; expected it absent or {neutral!r})")
    for key in ("attention_bias", "mlp_bias"):
        if key in defaults and get(key):
            raise ConfigError(f"{key}={hf[key]!r} is not supported for {arch} (expected false: Kiln "
                              f"models no bias on o_proj or the MLP)")
    if family in GEMMA:  # hidden_act, which Gemma-2 configs also carry, is not what HF builds the MLP from
        act = get("hidden_activation")
        if act != "gelu_pytorch_tanh":
            raise ConfigError(f"hidden_activation {act!r} is not supported; expected 'gelu_pytorch_tanh'")
    elif get("hidden_act") not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {get('hidden_act')!r} is not supported; expected 'silu'")
    else:
        act = "silu"

    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    kv_heads = get("num_key_value_heads")
    head_dim = get("head_dim")
    if head_dim is None:
        if family in _HEAD_DIM_NOT_NULL and "head_dim" in hf:  # HF has no fallback: the model cannot be built
            raise ConfigError(f"head_dim null is not supported for {arch}; expected an integer")
        head_dim = hidden // heads
    max_pos = get("max_position_embeddings")
    local_theta = None
    if family == "gemma3_text":  # sliding layers rotate with a base of their own
        hf, local_theta = _gemma3_local_rope(hf, get)
    theta, scaling, partial_rotary = rope_of(hf, max_pos, get("rope_theta"), phi3=family == "phi3")
    window = _sliding_window(hf, family, get, max_pos)
    moe = _moe(hf, family, arch, get) if family in MOE_FAMILIES else {}
    extra = {}
    if family == "granite":
        extra.update(_granite(get))
    if family == "smollm3":
        extra["nope_layers"] = [i for i, r in enumerate(_smollm3_rope_layers(hf, get)) if not r]
    if family == "olmo2":  # norms on the blocks' outputs, and q/k norms over the whole projections
        extra.update(pre_norm=False, post_norm=True, qk_layernorm_scope="projection")
    if family in GEMMA:
        extra.update(_gemma(hf, family, get, dtype or default_dtype(hf)), rotary_base_local=local_theta)
    return PretrainedConfig(
        architecture=arch,
        dtype=dtype or default_dtype(hf),
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads if kv_heads is None else kv_heads,
        head_size=head_dim,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=max_pos,
        hidden_act=act,
        norm_epsilon=float(get("rms_norm_eps")),
        rotary_base=theta,
        rotary_scaling=scaling,
        partial_rotary_factor=partial_rotary,
        # Qwen2 always has q/k/v biases, Qwen2-MoE when qkv_bias says so (and neither on o_proj)
        attn_bias=family == "qwen2" or (family == "qwen2_moe" and bool(get("qkv_bias"))),
        qk_layernorm=family in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text"),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        mapping=mapping,
        **moe,
        **extra,
        **window,
    )


def _gemma(hf: dict, family: str, get, dtype: str) -> dict:
    """Gemma 2 and 3's sandwich norms (before and after attention and MLP) multiplying by 1 + weight,
    the embedding scaled by sqrt(hidden_size) (rounded to the weights' dtype, as HF does), scores by
    query_pre_attn_scalar ** -0.5, and the soft caps: of the logits, and (Gemma 2) of the scores."""
    import torch

    if get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention true is not supported; expected false (causal attention)")
    caps = {key: None if get(key) is None else _number(key, get(key), "null or a number > 0", _positive)
            for key in ("final_logit_softcapping", "attn_logit_softcapping")}
    scalar = _number("query_pre_attn_scalar", get("query_pre_attn_scalar"), "a number > 0", _positive)
    embed = torch.tensor(hf["hidden_size"] ** 0.5).to(getattr(torch, dtype)).item()
    return dict(pre_norm=True, post_norm=True, norm_weight_offset=1.0, embedding_multiplier=embed,
                attention_multiplier=scalar ** -0.5, **caps)


def _gemma3_local_rope(hf: dict, get) -> tuple[dict, float]:
    """(hf with the global layers' rope only, the sliding layers' base). transformers 4 writes
    rope_local_base_freq beside the global rope_theta/rope_scaling; 5 keys rope_parameters by layer type."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "sliding_attention" in params:
        local = params["sliding_attention"] or {}
        if local.get("rope_type", local.get("type", "default")) != "default" or set(local) - {
                "rope_type", "type", "rope_theta"}:
            raise ConfigError(f"rope_parameters.sliding_attention {local} is not supported; expected the default "
                              f"rope type with rope_theta only")
        theta = local.get("rope_theta", DEFAULTS["gemma3_text"]["rope_local_base_freq"])
        hf = {**hf, "rope_parameters": params.get("full_attention")}
        top = hf.get("rope_local_base_freq")
        if top is not None and float(top) != float(theta):
            raise ConfigError(f"rope_local_base_freq {top} and rope_parameters.sliding_attention.rope_theta {theta} "
                              f"disagree; expected one value")
    else:
        theta = get("rope_local_base_freq")
    return hf, _number("rope_local_base_freq", theta, "a number > 0", _positive)


def _granite(get) -> dict:
    """Granite's four scalars (HF's defaults are 1.0 for all, the attention multiplier included: it
    replaces head_dim ** -0.5 as the scores' scale)."""
    values = {key: _number(key, get(key), "a finite number", math.isfinite)
              for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier")}
    values["logits_scaling"] = _number("logits_scaling", get("logits_scaling"),
                                       "a finite number other than 0 (the logits are divided by it)",
                                       lambda v: math.isfinite(v) and v != 0)
    return values


def _smollm3_rope_layers(hf: dict, get) -> list[int]:
    """SmolLM3's no_rope_layers: per layer, 1 where it uses rotary embedding and 0 where not (NoPE);
    absent, every no_rope_layer_interval-th layer is NoPE, as HF derives it."""
    n, layers = hf["num_hidden_layers"], get("no_rope_layers")
    if layers is None:
        interval = _integer("no_rope_layer_interval", get("no_rope_layer_interval"), 1)
        return [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(layers, list) or len(layers) != n or any(v not in (0, 1) or isinstance(v, float) for v in layers):
        raise ConfigError(f"no_rope_layers {layers!r} is not supported; expected {n} entries of 1 (rotary "
                          f"embedding) or 0 (none)")
    return [int(v) for v in layers]


def _moe(hf: dict, family: str, arch: str, get) -> dict:
    """PretrainedConfig's MoE fields, as HF's sparse blocks compute them: softmax over all experts,
    the top num_experts_per_tok, renormalized always (Mixtral) or when norm_topk_prob (Qwen)."""
    keys = EXPERTS_KEYS[family]
    given = {k: hf[k] for k in keys if k in hf}
    if len(set(map(repr, given.values()))) > 1:
        (k1, v1), (k2, v2) = given.items()
        raise ConfigError(f"{k1} {v1!r} and {k2} {v2!r} disagree; expected one number of experts (transformers "
                          f"4 reads {keys[0]}, 5 maps {keys[-1]} onto num_local_experts)")
    experts_key = next(iter(given), keys[0])
    experts = _integer(experts_key, given.get(experts_key, get(keys[0])), 1)
    top_k = get("num_experts_per_tok")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(f"num_experts_per_tok {top_k!r} is not supported; expected an integer in 1 .. "
                          f"{experts} ({experts_key})")
    if family == "mixtral":  # HF's Mixtral always renormalizes; its experts are intermediate_size wide
        return dict(moe=MoeConfig(num_experts=experts, top_k=top_k, normalization_mode=1),
                    moe_intermediate_size=hf["intermediate_size"])
    layers = get("mlp_only_layers")
    layers = [] if layers is None else layers
    if not isinstance(layers, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
        raise ConfigError(f"mlp_only_layers {layers!r} is not supported; expected a list of layer indices "
                          f"(integers)")
    shared = _integer("shared_expert_intermediate_size", get("shared_expert_intermediate_size"), 0) \
        if family == "qwen2_moe" else 0
    return dict(moe=MoeConfig(num_experts=experts, top_k=top_k, normalization_mode=1 if get("norm_topk_prob") else 0,
                              shared_expert_intermediate_size=shared),
                moe_intermediate_size=_integer("moe_intermediate_size", get("moe_intermediate_size"), 1),
                decoder_sparse_step=_integer("decoder_sparse_step", get("decoder_sparse_step"), 1),
                mlp_only_layers=list(layers))


def _number(key: str, value, expected: str, ok) -> float:
    """value (an int or float, not a bool, for which ok holds) as a float, else a one-line error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ConfigError(f"{key} {value!r} is not supported; expected {expected}")
    return float(value)


def _positive(value) -> bool:
    return value > 0


def _integer(key: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} {value!r} is not supported; expected an integer >= {minimum}")
    return value


def _text_model(hf: dict) -> tuple[dict, str]:
    """The dict to read and its architecture. A nested text_config (as multimodal and some
    transformers 5 configs carry) holds the text model's keys; the outer ones fill in the rest."""
    text = hf.get("text_config")
    if text is not None:
        if not isinstance(text, dict):
            raise ConfigError(f"text_config must be an object, got {text!r}")
        outer = hf.get("architectures") or []
        hf = {**{k: v for k, v in hf.items() if k not in ("text_config", "model_type")}, **text}
        hf["architectures"] = outer if outer and outer[0] in SUPPORTED_ARCHITECTURES else text.get("architectures")
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    arch = archs[0] if archs else FAMILIES.get(model_type, model_type or "<none>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architecture {arch!r} is not supported; expected one of "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    # HF's Auto classes build the model from model_type, not from architectures.
    if model_type is not None and FAMILIES.get(model_type) != arch:
        raise ConfigError(f"model_type {model_type!r} does not match architecture {arch} (expected "
                          f"model_type {ARCH_FAMILY[arch]!r})")
    return hf, arch


def _sliding_window(hf: dict, family: str, get, max_pos: int) -> dict:
    """PretrainedConfig's sliding_window and sliding_window_layers: the window and the layers HF slides
    it over (none when it is at least max_position_embeddings: no query could reach past it)."""
    if family in ("llama", "granite", "olmo2"):
        return {}
    window = get("sliding_window")
    n = hf["num_hidden_layers"]
    if family in ("mistral", "mixtral", "phi3"):  # no switch: a window is in effect whenever one is given
        sliding = list(range(n)) if window is not None else []
    elif family == "qwen3_moe":  # only with use_sliding_window, then on every layer
        sliding = list(range(n)) if get("use_sliding_window") and window is not None else []
    elif family == "qwen2_moe":
        # transformers 5 slides on the layers layer_types marks; transformers 4's eager/SDPA mask on
        # every layer (its flash path on those from max_window_layers on): refuse any window at all.
        _check_qwen2_moe_layer_types(hf, get, n)
        sliding = list(range(n)) if get("use_sliding_window") and window is not None else []
    elif family in GEMMA:  # the layers layer_types marks (absent: all but every sliding_window_pattern-th)
        pattern = _integer("sliding_window_pattern", get("sliding_window_pattern"), 1) if family == "gemma3_text" \
            else 2  # Gemma 2 alternates
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                          for i in range(n)]
        _check_layer_types(types, n)
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"] if window is not None else []
    elif family == "smollm3":  # only with use_sliding_window, on the layers layer_types marks (NoPE ones if absent)
        on = bool(get("use_sliding_window")) and window is not None
        types = hf.get("layer_types") or ["sliding_attention" if on and not r else "full_attention"
                                          for r in _smollm3_rope_layers(hf, get)]
        _check_layer_types(types, n)
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"] if on else []
    else:  # Qwen2/Qwen3: only with use_sliding_window, on the layers layer_types marks
        if not get("use_sliding_window"):
            window = None
        types = hf.get("layer_types") or [
            "sliding_attention" if window is not None and i >= get("max_window_layers") else "full_attention"
            for i in range(n)]
        _check_layer_types(types, n)
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"] if window is not None else []
    # Gemma 3 keeps it whatever its length: its sliding layers are also those with the local rope.
    if not sliding or (window >= max_pos and family != "gemma3_text"):
        return {}
    if family == "qwen2_moe":
        raise ConfigError(
            f"sliding_window {window} is smaller than max_position_embeddings {max_pos} (on layer(s) "
            f"{', '.join(map(str, sliding))}); a windowed Qwen2-MoE is not supported (transformers 4 slides every "
            f"layer, 5 those layer_types marks; expected sliding_window null or >= max_position_embeddings)")
    window = _integer("sliding_window", window, 1)
    return dict(sliding_window=window, sliding_window_layers=None if len(sliding) == n else sliding)


def _check_layer_types(types, n: int) -> None:
    if not isinstance(types, list) or len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
        raise ConfigError(f"layer_types {types} is not supported; expected {n} entries of "
                          f"'full_attention' or 'sliding_attention'")


def _check_qwen2_moe_layer_types(hf: dict, get, n: int) -> None:
    """transformers 5's Qwen2-MoE gives the layers layer_types marks sliding_window if
    use_sliding_window, else 0 (it writes `sliding_window: 0` then): marked layers need the switch."""
    types = hf.get("layer_types")
    if types is None:
        return
    _check_layer_types(types, n)
    marked = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if marked and not get("use_sliding_window"):
        raise ConfigError(f"layer_types marks layer(s) {', '.join(map(str, marked))} 'sliding_attention' but "
                          f"use_sliding_window is false (transformers 5 then slides a window of 0); expected "
                          f"'full_attention' on every layer")


def default_dtype(hf: dict) -> str:
    # transformers >= 4.56 writes "dtype"; older versions "torch_dtype".
    key = "dtype" if hf.get("dtype") is not None else "torch_dtype"
    name = hf.get(key) or "float32"
    if name not in DTYPES:
        raise ConfigError(f"{key} {name!r} is not supported; pass --dtype with one of {', '.join(DTYPES)}")
    return name
