"""Tiny random-weight HF models from the real transformers config classes, with a real tokenizer."""
import functools
import glob
import sysconfig
from pathlib import Path

import torch


@functools.lru_cache(maxsize=1)
def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(glob.glob(str(stdlib / "json" / "*.py")))[:6]
    return [Path(f).read_text() for f in files]


def save_tokenizer(path: Path, vocab_size: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)


COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=0, eos_token_id=1, pad_token_id=2, initializer_range=0.08)

VARIANTS = {
    # GQA, tied embeddings, llama3 rope scaling
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # MQA, untied, linear rope scaling
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=1, tie_word_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # dynamic NTK with prompts that run past max_position_embeddings
    "llama_dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(
        max_position_embeddings=24, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    # the llama above, 4 layers deep: an EAGLE-3 target whose draft reads three different layers
    "llama_4layers": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=4, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # the llama above with its first layer only: a draft model for speculative decoding that agrees
    # with it often, not always
    "llama_draft": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=1, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, tie_word_embeddings=False)),
    # a 12-token sliding window on every layer: KV blocks behind it are dropped
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=12, tie_word_embeddings=False)),
    # qkv bias
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, use_sliding_window=False)),
    # q/k RMSNorm, head_dim != hidden / heads
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False,
                                                       use_sliding_window=False)),
    # mixtures of experts: top 2 of 8, renormalized
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2,
                                                             sliding_window=None)),
    # top 4 of 8 as they are, a gated shared expert, qkv bias, layer 1 a dense MLP
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        mlp_only_layers=[1], norm_topk_prob=False, use_sliding_window=False, tie_word_embeddings=False)),
    # Granite's scalars: the embedding and each block's output scaled, the attention scale and logits divided
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
        logits_scaling=8.0)),
    # soft caps low enough to bend the scores and logits of random weights; alternating sliding layers
    "gemma2_capped": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=12, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, attn_implementation="eager")),
    # Phi-4-mini's LongRoPE over 3/4 of each head: short factors up to 24 tokens, long ones past
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=24, sliding_window=None,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                      "long_factor": [1.5 ** i for i in range(6)]})),
    # norms on the blocks' outputs, q/k norms over the whole projections; MQA
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=False)),
}


def make_model(name: str, path: Path, dtype=torch.float32, seed: int = 0) -> Path:
    import transformers

    config_cls, model_cls, extra = VARIANTS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    if getattr(config, "attention_bias", False) or model_cls in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        with torch.no_grad():  # biases start at zero; make them count
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path)
    return path


PROMPTS = [
    "import json",
    "def encode(self, o):\n    \"\"\"Return a JSON string",
    "class JSONDecodeError(ValueError):\n    \"\"\"Subclass of ValueError with the following additional properties:\n\n    msg: The unformatted error message\n    doc: The JSON document being parsed",
    "if __name__ == '__main__':\n    main()\n\n# a comment that runs on for a while, so that this prompt is the longest of them all by some margin",
    "x",
]
