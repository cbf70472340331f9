"""The unquantized tiny models the pre-quantized fixtures next to this file were made from.

Shapes admit every group size a format uses (32, 64, 128: hidden 128, intermediate 256), with GQA
(4 query heads over 2 KV heads); Qwen2 adds the qkv bias and tied embeddings.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for tiny_models

SHAPE = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=2,
             initializer_range=0.08)
ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, use_sliding_window=False))}


def make_base(arch: str, path: Path) -> Path:
    """A float32 HF model dir (seeded random weights, a real BPE tokenizer) for `arch`."""
    import transformers
    from tiny_models import save_tokenizer

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**SHAPE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, SHAPE["vocab_size"])
    return path


def calibration_texts(n: int = 16, chars: int = 512) -> list[str]:
    """Calibration text without a network: the stdlib sources tiny_models trains its tokenizer on."""
    from tiny_models import corpus

    text = "\n".join(corpus())
    return [text[i * chars:(i + 1) * chars] for i in range(n)]


MOE_ARCHS = {  # the MoE bases: 4 experts, top-2, expert width 128 (Qwen2-MoE adds a 256-wide shared expert)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                     tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(moe_intermediate_size=128, shared_expert_intermediate_size=256, num_experts=4,
                       num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                       use_sliding_window=False, tie_word_embeddings=False)),
}


def make_moe_base(arch: str, path: Path) -> Path:
    """A float32 HF mixture-of-experts model dir (seeded random weights, make_base's tokenizer) for `arch`."""
    import transformers
    from tiny_models import save_tokenizer

    config_cls, model_cls, extra = MOE_ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**SHAPE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, SHAPE["vocab_size"])
    return path
