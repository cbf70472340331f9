"""What a model's forward asks of its kernels, whichever family runs them.

`Kernels` is one kernel family (vLLM's CustomOp idea: plain torch, C++ CPU plugins, later GPU
kernels), `StepMeta` one step's attention metadata, passed whole instead of seven tensors per call,
and `AttentionLayer` what attention needs to know of a layer, fixed when the engine is built.
"""
from dataclasses import dataclass

import torch
from torch import nn

from kiln.models import linear, lora, moe


@dataclass
class StepMeta:
    """Where each token's K/V goes and which pages each request reads (DESIGN.md, "The engine format")."""
    slot_mapping: torch.Tensor
    ctx_token_index: torch.Tensor
    ctx_block_tables: torch.Tensor
    ctx_context_lens: torch.Tensor
    gen_token_index: torch.Tensor
    gen_block_tables: torch.Tensor
    gen_context_lens: torch.Tensor

    @property
    def pages(self) -> tuple[torch.Tensor, ...]:
        """The paged-attention arguments, in the plugins' order."""
        return (self.ctx_token_index, self.ctx_block_tables, self.ctx_context_lens, self.gen_token_index,
                self.gen_block_tables, self.gen_context_lens)


@dataclass(frozen=True)
class AttentionLayer:
    """index: the layer's place in the rank's KV pool; window: its sliding window (0: none); softcap:
    Gemma 2's score cap (0: none); rotary: whether it rotates q and k (SmolLM3's NoPE layers do not);
    qk_norm: "head" (Qwen3, Gemma 3), "projection" (OLMo 2) or None; quantized_kv: an 8-bit pool."""
    index: int
    heads: int
    kv_heads: int
    head_size: int
    scale: float
    eps: float
    window: int = 0
    softcap: float = 0.0
    rotary: bool = True
    qk_norm: str | None = None
    quantized_kv: bool = False


class Kernels:
    """One kernel family. An op a family does not have is None, and the op set takes the reference's."""
    # kv_cache_write(kv_cache, layer, k, v, slot_mapping, kv_scale=None): K/V into the pool in place
    kv_cache_write = None
    # paged_attention(q, kv_cache, layer, *StepMeta.pages, scale, [kv_scale], window=, softcap=) -> [T, H, D]
    paged_attention = None
    rms_norm = None
    fused_add_rms_norm = None
    rotary_embedding = None
    silu_and_mul = None
    gelu_tanh_and_mul = None
    # The lm_head, and a tied embedding's rows, in kiln.models.linear's packed layout (the C++ plugin)
    packed_gemm = False

    # The GEMM group: a family builds the layers that own their weights' layout.
    def linear(self, config, weights: dict, names: list[str], bias=None) -> nn.Module:
        """One layer for the checkpoint linears `names` sharing their input (kiln/models/linear.py)."""
        return linear.make_linear(config, weights, names, bias, self.packed_gemm)

    def moe(self, config, weights: dict, prefix: str, rank: int, silu_and_mul) -> nn.Module:
        """A mixture-of-experts MLP (kiln/models/moe.py; its shared expert on silu_and_mul)."""
        return moe.MoeMLP(config, weights, prefix, rank, self.packed_gemm, silu_and_mul)

    def lora(self, slots, ranks, pools) -> lora.StepAdapters:
        """One step's LoRA updates: segmented on the C++ plugin beside its GEMMs, else dense GEMMs inline."""
        return lora.StepAdapters(slots, ranks, pools, self.packed_gemm)

    def fused_attention(self, layer: AttentionLayer):
        """One call from a layer's QKV projection to its attention output (norms, rope, KV write and
        paged attention), or None where the family has none for such a layer."""
        return None
