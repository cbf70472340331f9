"""A layer's attention from its QKV projection: one fused call where the op set has one for the
layer, else split (q/k norms, rotary, the KV write, paged attention). Which, and every family
difference (window, soft cap, NoPE, q/k norm scope, an 8-bit pool's scale), is fixed at build."""
import torch
from torch import nn

from kiln.models.ops.base import AttentionLayer, StepMeta
from kiln.models.ops.op_set import OpSet
from kiln.models.parallel import TensorParallel


class FusedAttention(nn.Module):
    """kiln_cpp::attention: per-head q/k norms, rope, the KV write and paged attention in one call."""

    def __init__(self, layer: AttentionLayer, call, q_norm, k_norm):
        super().__init__()
        self.layer, self.call, self.q_norm, self.k_norm = layer, call, q_norm, k_norm

    def forward(self, qkv, cos_sin, kv_cache, meta: StepMeta):
        a = self.layer
        return self.call(qkv, *cos_sin, kv_cache, a.index, meta.slot_mapping, *meta.pages, a.heads, a.scale,
                         self.q_norm, self.k_norm, a.eps, a.window, a.softcap)


class SplitAttention(nn.Module):
    def __init__(self, layer: AttentionLayer, ops: OpSet, qk_norm: nn.Module, kv_scale: torch.Tensor | None):
        super().__init__()
        self.layer, self.ops, self.qk_norm = layer, ops, qk_norm
        self.register_buffer("kv_scale", kv_scale)
        # The plugins' optional arguments, passed only where the layer has them
        self.extra = ({"window": layer.window} if layer.window else {}) | (
            {"softcap": layer.softcap} if layer.softcap else {})

    def forward(self, qkv, cos_sin, kv_cache, meta: StepMeta):
        a, o = self.layer, self.ops
        H, KH, D = a.heads, a.kv_heads, a.head_size
        q, k, v = qkv.split([H * D, KH * D, KH * D], dim=-1)
        q, k = self.qk_norm(q, k)
        v = v.view(-1, KH, D)
        if a.rotary:
            q, k = o.rotary_embedding(q, k, *cos_sin)
        scale = () if self.kv_scale is None else (self.kv_scale,)
        o.kv_cache_write(kv_cache, a.index, k, v, meta.slot_mapping, *scale)
        return o.paged_attention(q, kv_cache, a.index, *meta.pages, a.scale, *scale, **self.extra)


class HeadViews(nn.Module):
    """q [T, H * D], k [T, KH * D] -> [T, H, D], [T, KH, D]; with weights, each head RMS-normed (Qwen3, Gemma 3)."""

    def __init__(self, layer: AttentionLayer, ops: OpSet, q_weight=None, k_weight=None):
        super().__init__()
        self.layer, self.norm = layer, ops.rms_norm
        self.q_weight, self.k_weight = q_weight, k_weight

    def forward(self, q, k):
        a = self.layer
        q, k = q.view(-1, a.heads, a.head_size), k.view(-1, a.kv_heads, a.head_size)
        if self.q_weight is None:
            return q, k
        return self.norm(q, self.q_weight, a.eps), self.norm(k, self.k_weight, a.eps)


class ProjectionNorm(nn.Module):
    """RMSNorm over the whole q and k projections (OLMo 2), of which this rank holds its share: the
    sum of squares is summed over the ranks, a KV head that several ranks hold (tp > KV heads)
    counted once."""

    def __init__(self, layer: AttentionLayer, tp: TensorParallel, heads: int, kv_heads: int, q_weight, k_weight):
        super().__init__()
        self.layer, self.tp, self.heads, self.kv_heads = layer, tp, heads, kv_heads
        self.q_weight, self.k_weight = q_weight, k_weight

    def forward(self, q, k):
        a = self.layer
        q, k = self._norm(q, self.q_weight, self.heads), self._norm(k, self.k_weight, self.kv_heads)
        return q.view(-1, a.heads, a.head_size), k.view(-1, a.kv_heads, a.head_size)

    def _norm(self, x, weight, heads: int):
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:
            squares = self.tp.all_reduce(squares) / max(1, self.tp.size // heads)
        return (weight * (xf * torch.rsqrt(squares / (heads * self.layer.head_size) + self.layer.eps))).to(x.dtype)


def make_attention(layer: AttentionLayer, ops: OpSet, tp: TensorParallel, heads: int, kv_heads: int,
                   q_weight=None, k_weight=None, kv_scale=None) -> nn.Module:
    """heads, kv_heads: the model's totals (a projection norm's divisor); q/k_weight: the q/k norms."""
    fused = ops.fused_attention(layer)
    if fused is not None:
        return FusedAttention(layer, fused, q_weight, k_weight)
    if layer.qk_norm == "projection":
        qk_norm = ProjectionNorm(layer, tp, heads, kv_heads, q_weight, k_weight)
    else:
        qk_norm = HeadViews(layer, ops, q_weight, k_weight)
    return SplitAttention(layer, ops, qk_norm, kv_scale)
