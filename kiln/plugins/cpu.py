"""Fast CPU paths: batched over sequences, ATen's fused kernels, no per-sequence Python loop."""
import torch
import torch.nn.functional as F


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


def kv_cache_write(kv_cache, layer, k, v, slot_mapping):
    block_size = kv_cache.shape[3]
    if (slot_mapping < 0).any():  # padding slots write nothing (the reference skips them)
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[layer, 0, blocks, offsets] = k.to(kv_cache.dtype)
    kv_cache[layer, 1, blocks, offsets] = v.to(kv_cache.dtype)


def _gather_kv(kv_cache, layer, block_tables):
    # [S, MB] pages -> [S, KH, MB * block_size, D]; a copy, which the C++ plugin avoids.
    k = kv_cache[layer, 0][block_tables].flatten(1, 2).transpose(1, 2)
    v = kv_cache[layer, 1][block_tables].flatten(1, 2).transpose(1, 2)
    return k, v


def paged_attention(q, kv_cache, layer, ctx_token_index, ctx_block_tables, ctx_context_lens,
                    gen_token_index, gen_block_tables, gen_context_lens, scale):
    out = torch.empty_like(q)
    if ctx_token_index.shape[0]:
        valid = ctx_token_index >= 0
        q_ctx = q[ctx_token_index.clamp(min=0)].transpose(1, 2)  # [Sc, H, Qmax, D]
        k, v = _gather_kv(kv_cache, layer, ctx_block_tables)
        q_lens = valid.sum(1)
        query_pos = (ctx_context_lens - q_lens)[:, None] + torch.arange(q_ctx.shape[2])
        query_pos = torch.minimum(query_pos, (ctx_context_lens - 1)[:, None])
        key_pos = torch.arange(k.shape[2])
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [Sc, Qmax, K]
        o = F.scaled_dot_product_attention(q_ctx, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None],
                                           scale=scale, enable_gqa=True)
        out[ctx_token_index[valid]] = o.transpose(1, 2)[valid]
    if gen_token_index.shape[0]:
        q_gen = q[gen_token_index][:, :, None, :]  # [Sg, H, 1, D]
        k, v = _gather_kv(kv_cache, layer, gen_block_tables)
        mask = torch.arange(k.shape[2])[None, :] < gen_context_lens[:, None]
        o = F.scaled_dot_product_attention(q_gen, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None],
                                           scale=scale, enable_gqa=True)
        out[gen_token_index] = o[:, :, 0]
    return out
