"""Fast CPU paths: batched over sequences, ATen's fused kernels, no per-sequence Python loop."""
import torch
import torch.nn.functional as F

from kiln.plugins import quant


def rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    residual = x + residual
    return F.rms_norm(residual, (x.shape[-1],), weight, eps), residual


def rotary_embedding(q, k, cos, sin):
    half = cos.shape[-1]
    cos, sin = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)

    def rotate(x):
        x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    return rotate(q), rotate(k)


def silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def kv_cache_write(kv_cache, layer, k, v, slot_mapping, kv_scale=None):
    # One index_put_ on the pool itself: a write through a view of it compiles to a copy of the
    # whole pool every step (DESIGN.md, constraint 3).
    block_size = kv_cache.shape[3]
    index = (torch.tensor(layer), torch.arange(2)[:, None], (slot_mapping // block_size)[None],
             (slot_mapping % block_size)[None])
    kv = torch.stack([k, v])
    kv_cache.index_put_(index, kv.to(kv_cache.dtype) if kv_scale is None else quant.quantize_to(kv, kv_scale, kv_cache.dtype))


def _gather_kv(kv_cache, layer, block_tables, dtype, kv_scale=None):
    # [S, MB] pages -> [S, KH, MB * block_size, D]; a copy, which the C++ plugin avoids.
    kv = kv_cache[layer][:, block_tables].flatten(2, 3).transpose(2, 3)
    kv = kv.to(dtype) if kv_scale is None else (kv.float() * kv_scale).to(dtype)
    return kv[0], kv[1]


def _seen(keys, query_pos, window):
    """Which keys a query at query_pos attends: causal, and within its sliding window (0: none)."""
    mask = keys <= query_pos
    return mask & (keys > query_pos - window) if window else mask


def _sdpa(q, k, v, mask, scale, softcap):
    """q [S, H, Q, D], k/v [S, KH, K, D], mask [S, 1, Q, K] (True: attend). SDPA has no soft cap:
    with one, the scores are written out."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh((q.float() @ k.float().transpose(-1, -2)) * (scale / softcap)) * softcap
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.float()).to(q.dtype)


def paged_attention(q, kv_cache, layer, ctx_token_index, ctx_block_tables, ctx_context_lens,
                    gen_token_index, gen_block_tables, gen_context_lens, scale, kv_scale=None, window=0,
                    softcap=0.0):
    """Traceable: sizes come only from input shapes, and both phases always run (either may be
    empty), so the graph compiler can take it whole instead of calling back into Python. window: the
    layer's sliding window (0: none), a query at p seeing keys p - window < key <= p; softcap: scores
    soft-capped, tanh(s / softcap) * softcap (0: none)."""
    T = q.shape[0]
    out = q.new_zeros(T + 1, *q.shape[1:])  # row T takes the context phase's padding
    # Context phase: [Sc, H, Qmax, D] queries, causal from each chunk's offset in its sequence.
    valid = ctx_token_index >= 0
    q_ctx = q[ctx_token_index.clamp(min=0)].transpose(1, 2)
    k, v = _gather_kv(kv_cache, layer, ctx_block_tables, q.dtype, kv_scale)
    query_pos = (ctx_context_lens - valid.sum(1))[:, None] + torch.arange(q_ctx.shape[2])
    query_pos = torch.minimum(query_pos, (ctx_context_lens - 1)[:, None])
    mask = _seen(torch.arange(k.shape[2])[None, None, :], query_pos[:, :, None], window)  # [Sc, Qmax, K]
    o = _sdpa(q_ctx, k, v, mask[:, None], scale, softcap)
    dest = torch.where(valid, ctx_token_index, T).flatten()
    out.index_put_((dest,), o.transpose(1, 2).flatten(0, 1))
    # Generation phase: one query per sequence, never padded to the context phase's Qmax.
    k, v = _gather_kv(kv_cache, layer, gen_block_tables, q.dtype, kv_scale)
    mask = _seen(torch.arange(k.shape[2])[None, :], (gen_context_lens - 1)[:, None], window)
    o = _sdpa(q[gen_token_index][:, :, None], k, v, mask[:, None, None], scale, softcap)
    out.index_put_((gen_token_index,), o[:, :, 0])
    return out[:T]
