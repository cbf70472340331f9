"""Tiny random-weight models made from real published config.json files, saved by the installed
transformers, and HF's greedy answers for them: the oracle of tests/test_hf_parity.py.

Only the sizes are shrunk (and bos/eos ids dropped or moved into the tiny vocabulary; mixtures of
experts keep their expert count, top-k and shared expert); every key that changes the math (rope base
and scaling, norm epsilon, ties, biases, head_dim, sliding-window switches) is the published one.
Weights are drawn per tensor name as saved, independently of transformers' initialisation, so both
transformers majors save the same numbers; their std (0.15, far above HF's init) keeps greedy paths
from collapsing into repeats that would hide a wrong rotary base.

Also a script, so that another venv's transformers (the 5.x one `make test` creates) saves the
same models and answers for them:

    python tests/published_models.py OUT_DIR
"""
import json
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

NEW_TOKENS = 24
PROMPT_LENGTHS = (3, 8, 13, 21, 34)
STD = 0.15
# Granite multiplies the embedding by 12 and each block's output by 0.22: at 0.15 the stream is nearly
# the embedding alone and every prompt repeats one token.
STD_OF = {"granite3.1": 1.0, "gemma2": 0.05}  # Gemma 2's scores (no q/k norm) flatten at 0.15: one token repeats

_LLAMA_3_2_1B = {  # meta-llama/Llama-3.2-1B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
_QWEN2_5_0_5B = {  # Qwen/Qwen2.5-0.5B
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 151936}
_QWEN3_0_6B = {  # Qwen/Qwen3-0.6B
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
_MISTRAL_7B_V0_3 = {  # mistralai/Mistral-7B-v0.3
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 32768}
_QWEN2_5_7B_INSTRUCT_YARN = {  # Qwen/Qwen2.5-7B-Instruct, with the rope_scaling its README adds for 128K
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}

_PHI_3_MINI_4K = {  # microsoft/Phi-3-mini-4k-instruct: fused qkv_proj and gate_up_proj, a 2047-token window
    "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "embd_pdrop": 0.0,
    "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
    "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.2", "use_cache": True, "vocab_size": 32064}
_PHI_3_5_MINI = {  # microsoft/Phi-3.5-mini-instruct: LongRoPE (short factors up to 4096 tokens, long ones past)
    "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "embd_pdrop": 0.0,
    "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "model_type": "phi3", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
    "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": [
        1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
        1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
        4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
        17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
        32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
        50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
        62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
        63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
        64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
        64.51000213623047, 64.52999877929688, 64.83999633789062], "short_factor": [
        1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
        1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
        1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
        1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
        1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
        2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
        2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
        2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
        2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
        2.749999523162842, 2.8399994373321533], "type": "longrope"},
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.3", "use_cache": True, "attention_bias": False, "vocab_size": 32064}
_PHI_4_MINI = {  # microsoft/Phi-4-mini-instruct: LongRoPE over the first 3/4 of each head, GQA, tied embeddings
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 199999,
    "embd_pdrop": 0.0, "eos_token_id": 199999, "full_attn_mod": 1, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "interpolate_factor": 1, "lm_head_bias": False,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "phi3", "num_attention_heads": 24,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "original_max_position_embeddings": 4096,
    "pad_token_id": 199999, "partial_rotary_factor": 0.75, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": [
        1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
        2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
        6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
        16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23,
        32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77],
        "short_factor": [1.0] * 48, "type": "longrope"},
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0", "use_cache": True, "vocab_size": 200064}
_GEMMA_2_2B = {  # google/gemma-2-2b: alternating sliding and global layers, soft-capped scores and logits
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
    "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000}
_GEMMA_3_1B_IT = {  # google/gemma-3-1b-it: five sliding (local rope) layers per global one, GeGLU, sandwich norms
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}
_MISTRAL_7B_V0_1 = {  # mistralai/Mistral-7B-v0.1: a 4096-token sliding window on every layer
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}
# Qwen/Qwen2.5-0.5B with its sliding window switched on (use_sliding_window, as Qwen2 allows): layers
# from max_window_layers on slide, the first stays global.
_QWEN2_5_0_5B_SWA = dict(_QWEN2_5_0_5B, use_sliding_window=True, max_window_layers=1, sliding_window=4096)

_MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": True, "vocab_size": 32000}
_QWEN1_5_MOE_A2_7B = {  # Qwen/Qwen1.5-MoE-A2.7B (Qwen2-MoE: 60 experts, top 4, a gated shared expert)
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.39.0.dev0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
_QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B (128 experts, top 8, renormalized, q/k norm)
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}

_GRANITE_3_1_2B = {  # ibm-granite/granite-3.1-2b-instruct
    "architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_dropout": 0.1,
    "attention_multiplier": 0.015625, "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "logits_scaling": 8.0, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "granite",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "pad_token_id": 0,
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 5000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.47.0", "use_cache": True,
    "vocab_size": 49155}
_OLMO_2_1B = {  # allenai/OLMo-2-0425-1B
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "eos_token_id": 100257,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 16, "num_hidden_layers": 16,
    "num_key_value_heads": 16, "pad_token_id": 100277, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 500000, "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.48.3",
    "use_cache": True, "vocab_size": 100352}
_SMOLLM3_3B = {  # HuggingFaceTB/SmolLM3-3B (every fourth layer without rotary embedding)
    "architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None,
    "eos_token_id": 128012, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 11008, "layer_types": ["full_attention"] * 36, "max_position_embeddings": 65536,
    "max_window_layers": 28, "mlp_bias": False, "model_type": "smollm3", "no_rope_layer_interval": 4,
    "no_rope_layers": [1, 1, 1, 0] * 9, "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 4, "pad_token_id": 128004, "pretraining_tp": 2, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.54.0.dev0", "use_cache": False,
    "use_sliding_window": False, "vocab_size": 128256}

PUBLISHED = {"llama3.2": _LLAMA_3_2_1B, "qwen2.5": _QWEN2_5_0_5B, "qwen3": _QWEN3_0_6B,
             "mistral": _MISTRAL_7B_V0_3, "qwen2.5-yarn": _QWEN2_5_7B_INSTRUCT_YARN, "mixtral": _MIXTRAL_8X7B,
             "qwen1.5-moe": _QWEN1_5_MOE_A2_7B, "qwen3-moe": _QWEN3_30B_A3B, "granite3.1": _GRANITE_3_1_2B,
             "olmo2": _OLMO_2_1B, "smollm3": _SMOLLM3_3B, "mistral-v0.1": _MISTRAL_7B_V0_1,
             "qwen2.5-swa": _QWEN2_5_0_5B_SWA, "gemma2": _GEMMA_2_2B, "gemma3": _GEMMA_3_1B_IT,
             "phi3": _PHI_3_MINI_4K, "phi3.5": _PHI_3_5_MINI, "phi4-mini": _PHI_4_MINI}
# No eos: greedy runs its NEW_TOKENS on both sides without an end-of-sequence rule to agree on.
WINDOWED, WINDOW = ("mistral-v0.1", "qwen2.5-swa", "gemma2", "gemma3", "phi3"), 8
LONGROPE_SWITCH = 32  # prompts 3 and 8 stay short, 13 and 21 grow past it while generating, 34 start past it
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=None, pad_token_id=0)


def tiny_config(name: str) -> dict:
    published = PUBLISHED[name]
    cfg = {**published, **TINY}
    if name in WINDOWED:  # a window the prompts outgrow, so that it matters
        cfg["sliding_window"] = WINDOW
    if "moe_intermediate_size" in published:  # experts narrower than the dense MLP, as published
        cfg["moe_intermediate_size"] = 32
    if "shared_expert_intermediate_size" in published:
        cfg["shared_expert_intermediate_size"] = 96
    if "no_rope_layers" in published:  # one NoPE layer after three rotary ones, as published
        cfg["num_hidden_layers"] = 4
    if (published.get("rope_scaling") or {}).get("type") == "longrope":
        # the switch from short to long factors inside the prompts + NEW_TOKENS (a 32x longer context, as
        # published); each factor list subsampled to the rotary dims' pairs (the long ones keep their ramp)
        cfg["original_max_position_embeddings"] = LONGROPE_SWITCH
        cfg["max_position_embeddings"] = LONGROPE_SWITCH * published["max_position_embeddings"] // published[
            "original_max_position_embeddings"]
        pairs = int(TINY["hidden_size"] // TINY["num_attention_heads"] * published.get("partial_rotary_factor", 1)) // 2
        cfg["rope_scaling"] = {k: v[::len(v) // pairs][:pairs] if isinstance(v, list) else v
                               for k, v in published["rope_scaling"].items()}
    if "sliding_window_pattern" in published:  # a global layer after five sliding ones
        cfg["num_hidden_layers"] = published["sliding_window_pattern"]
    for key in ("no_rope_layers", "layer_types"):  # per-layer lists: the first layers'
        if key in published:
            cfg[key] = published[key][:cfg["num_hidden_layers"]]
    if "head_dim" in published:  # keep head_dim != hidden / heads where the published one is
        decoupled = published["head_dim"] != published["hidden_size"] // published["num_attention_heads"]
        cfg["head_dim"] = 32 if decoupled else TINY["hidden_size"] // TINY["num_attention_heads"]
    return cfg


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def save(name: str, path: Path) -> Path:
    """The tiny model, loaded from its config.json and saved as the installed transformers does."""
    import transformers

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(tiny_config(name), indent=2))
    config = transformers.AutoConfig.from_pretrained(path)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(path)
    # Values drawn per tensor name as saved, which both majors share (transformers 5's modules hold a
    # mixture's experts stacked, and save them per expert as 4.x does); tied tensors are saved once.
    weights = load_file(path / "model.safetensors")
    std = STD_OF.get(name, STD)
    for name, t in weights.items():
        values = torch.randn(t.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * std
        weights[name] = values + 1 if name.endswith("norm.weight") else values
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def hf_greedy(model_dir: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    """HF generate from the saved dir, the prompts batched (left-padded): each one's tokens and the
    logits that chose them.

    LongRoPE models: each prompt alone, every step HF's forward over the whole sequence. HF picks the
    factors of a batch by its longest row, so a batch is no oracle; and the step where a sequence first
    grows past the switch recomputes it with the long factors (transformers 4's generate drops the cache
    and does; 5.13's drops the cache but feeds the last token alone, which no model meant)."""
    import transformers

    # Gemma 2's soft-capped scores: HF's eager attention (transformers 5's SDPA path drops the cap)
    eager = {"attn_implementation": "eager"} if model_dir.name == "gemma2" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **eager).eval()
    if "longrope" in (model_dir / "config.json").read_text():
        alone = [recomputing_greedy(model, p) for p in prompts()]
        return [tokens for tokens, _ in alone], [steps for _, steps in alone]
    return _generate(model, prompts())


def recomputing_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
    """Greedy by HF's forward over the whole sequence at every step (no KV cache)."""
    tokens, steps = list(prompt), []
    with torch.no_grad():
        for _ in range(new_tokens):
            steps.append(model(torch.tensor([tokens])).logits[0, -1].float())
            tokens.append(int(steps[-1].argmax()))
    return tokens[len(prompt):], torch.stack(steps)


def _generate(model, batch: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    assert out.sequences.shape[1] == width + NEW_TOKENS  # no eos: the config has none
    steps = torch.stack(out.logits, dim=1).float()  # [prompts, NEW_TOKENS, vocab]
    return out.sequences[:, width:].tolist(), list(steps)


def write_oracle(name: str, out: Path) -> Path:
    """out/name: the saved HF dir; out/name.oracle.json and .logits.safetensors: HF's answers."""
    import transformers
    from safetensors.torch import save_file

    model_dir = save(name, out / name)
    tokens, logits = hf_greedy(model_dir)
    save_file({f"prompt{i}": t.contiguous() for i, t in enumerate(logits)}, str(out / f"{name}.logits.safetensors"))
    (out / f"{name}.oracle.json").write_text(json.dumps(
        {"transformers": transformers.__version__, "prompts": prompts(), "tokens": tokens}))
    return model_dir


def read_oracle(out: Path, name: str) -> dict:
    from safetensors.torch import load_file

    oracle = json.loads((out / f"{name}.oracle.json").read_text())
    logits = load_file(out / f"{name}.logits.safetensors")
    oracle["logits"] = [logits[f"prompt{i}"] for i in range(len(oracle["tokens"]))]
    oracle["model_dir"] = out / name
    return oracle


if __name__ == "__main__":
    torch.set_num_threads(2)
    root = Path(sys.argv[1])
    for family in PUBLISHED:
        write_oracle(family, root)
