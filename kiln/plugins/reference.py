"""Plain-torch reference implementations: the spec every other path of a plugin is held to.

Written for clarity, not speed: float32 math, explicit masks, one sequence at a time.
"""
import torch

from kiln.plugins import quant


def rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(q, k, cos, sin):
    """GPT-NeoX style rotation of the first 2 * cos.shape[-1] dims; q [T, H, D], cos/sin [T, D_rot/2]."""
    def rotate(x):
        half = cos.shape[-1]
        x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
        c, s = cos[:, None, :].float(), sin[:, None, :].float()
        rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        return torch.cat([rotated, x[..., 2 * half:].float()], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x):
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def kv_cache_write(kv_cache, layer, k, v, slot_mapping, kv_scale=None):
    """8-bit pools (int8, fp8) hold round/cast(x / kv_scale), kv_scale being the layer's static scale."""
    block_size = kv_cache.shape[3]
    if kv_scale is not None:
        k, v = quant.quantize_to(k, kv_scale, kv_cache.dtype), quant.quantize_to(v, kv_scale, kv_cache.dtype)
    for t, slot in enumerate(slot_mapping.tolist()):
        assert slot >= 0, "every token has a slot; the runtime never pads the flat batch"
        kv_cache[layer, 0, slot // block_size, slot % block_size] = k[t]
        kv_cache[layer, 1, slot // block_size, slot % block_size] = v[t]


def _attend(q, k, v, query_positions, scale, window=0, softcap=0.0):
    """q [Q, H, D] at absolute positions; k/v [L, KH, D] for positions 0..L-1, causal; with a sliding
    window, a query at p sees keys p - window < key <= p; softcap: scores become
    tanh(s / softcap) * softcap first."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    key_positions = torch.arange(k.shape[0])
    hidden = key_positions[None, :] > query_positions[:, None]
    if window:
        hidden |= key_positions[None, :] <= query_positions[:, None] - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _sequence_kv(kv_cache, layer, block_table, length, kv_scale):
    block_size = kv_cache.shape[3]
    blocks = block_table[: -(-length // block_size)]
    k = kv_cache[layer, 0, blocks].flatten(0, 1)[:length].float()
    v = kv_cache[layer, 1, blocks].flatten(0, 1)[:length].float()
    if kv_scale is not None:
        k, v = k * kv_scale.float(), v * kv_scale.float()
    return k, v


def paged_attention(q, kv_cache, layer, ctx_token_index, ctx_block_tables, ctx_context_lens,
                    gen_token_index, gen_block_tables, gen_context_lens, scale, kv_scale=None, window=0,
                    softcap=0.0):
    """window: this layer's sliding window (0: none); softcap: the scores' soft cap (0: none). This
    spec reads every block of a sequence and masks the keys outside the window; the C++ op never
    reads the blocks wholly before it (the KV cache manager may have freed them)."""
    out = torch.zeros_like(q)
    for i in range(ctx_token_index.shape[0]):
        tokens = ctx_token_index[i][ctx_token_index[i] >= 0]
        length = int(ctx_context_lens[i])
        k, v = _sequence_kv(kv_cache, layer, ctx_block_tables[i], length, kv_scale)
        positions = torch.arange(length - len(tokens), length)
        out[tokens] = _attend(q[tokens], k, v, positions, scale, window, softcap).to(q.dtype)
    for i in range(gen_token_index.shape[0]):
        length = int(gen_context_lens[i])
        k, v = _sequence_kv(kv_cache, layer, gen_block_tables[i], length, kv_scale)
        token = gen_token_index[i : i + 1]
        out[token] = _attend(q[token], k, v, torch.tensor([length - 1]), scale, window, softcap).to(q.dtype)
    return out
