"""Random-weight EAGLE-3 drafts in the published format (kiln/models/eagle3.py): LlamaForCausalLMEagle3's
config.json and tensor names, a smaller draft vocabulary with its d2t/t2d maps, no embedding table."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_draft(path: Path, target: dict, layer_ids=None, draft_vocab_size: int | None = None, seed: int = 0,
               scale: float = 0.08) -> Path:
    """target: the target's HF config.json."""
    g = torch.Generator().manual_seed(seed)
    H, V = target["hidden_size"], target["vocab_size"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    D = target.get("head_dim") or H // heads
    inter, Dv = target["intermediate_size"], draft_vocab_size or V

    def w(*shape):
        return torch.randn(*shape, generator=g) * scale

    def norm():
        return 1 + 0.1 * torch.randn(H, generator=g)

    tensors = {
        "fc.weight": w(H, 3 * H), "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(heads * D, 2 * H), "midlayer.self_attn.k_proj.weight": w(kv * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(kv * D, 2 * H), "midlayer.self_attn.o_proj.weight": w(H, heads * D),
        "midlayer.post_attention_layernorm.weight": norm(), "midlayer.mlp.gate_proj.weight": w(inter, H),
        "midlayer.mlp.up_proj.weight": w(inter, H), "midlayer.mlp.down_proj.weight": w(H, inter),
        "norm.weight": norm(), "lm_head.weight": w(Dv, H) * 4,
    }
    targets = torch.sort(torch.randperm(V, generator=g)[:Dv]).values
    tensors["d2t"] = targets - torch.arange(Dv)
    tensors["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill(0, targets, True)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    n = target["num_hidden_layers"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": D,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "hidden_act": "silu", "vocab_size": V,
        "draft_vocab_size": Dv, "max_position_embeddings": target["max_position_embeddings"],
        "rope_theta": target.get("rope_theta", 10000.0), "rope_scaling": target.get("rope_scaling"),
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids or (1, n // 2, n - 1)),
                         "use_aux_hidden_state": True},
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
