"""The plugin ops as `torch.library` custom ops (namespace `kiln`).

A graph that calls them keeps them as single nodes through `torch.export`, so each backend can map
them onto its own kernel (AOTInductor calls the registered implementation; TensorRT a plugin).
"""
from typing import Optional

import torch

from kiln.plugins import cpu


@torch.library.custom_op("kiln::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return cpu.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("kiln::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu.fused_add_rms_norm(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("kiln::rotary_embedding", mutates_args=())
def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cpu.rotary_embedding(q, k, cos, sin)


@rotary_embedding.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("kiln::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return cpu.silu_and_mul(x)


@silu_and_mul.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.custom_op("kiln::kv_cache_write", mutates_args=("kv_cache",))
def kv_cache_write(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scale: Optional[torch.Tensor] = None) -> None:
    cpu.kv_cache_write(kv_cache, layer, k, v, slot_mapping, kv_scale)


@kv_cache_write.register_fake
def _(kv_cache, layer, k, v, slot_mapping, kv_scale=None):
    return None


@torch.library.custom_op("kiln::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                    ctx_token_index: torch.Tensor, ctx_block_tables: torch.Tensor,
                    ctx_context_lens: torch.Tensor, gen_token_index: torch.Tensor,
                    gen_block_tables: torch.Tensor, gen_context_lens: torch.Tensor,
                    scale: float, kv_scale: Optional[torch.Tensor] = None, window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    return cpu.paged_attention(q, kv_cache, layer, ctx_token_index, ctx_block_tables, ctx_context_lens,
                               gen_token_index, gen_block_tables, gen_context_lens, scale, kv_scale, window, softcap)


@paged_attention.register_fake
def _(q, kv_cache, layer, *args):
    return torch.empty_like(q)
