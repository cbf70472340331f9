"""Paged attention over the KV pool, and the KV write into it.

The pool is the engine's [layers, 2, blocks, block_size, KV heads, D] (DESIGN.md, "The engine format");
a request's pages are its row of a block table. Both phases read pages in place, one
page per inner step, and never read a page wholly before a sliding window (the KV cache manager
may have freed it: its block table entry is -1).

- Context phase (prefill, chunked prefill): flash attention. One program per (sequence, KV head,
  block of its chunk's queries), whose rows are those queries times the KV head's group of query
  heads (GQA: each page read once per group); an online softmax over the pages from the window's
  start to the block's last position, causal from the chunk's offset in its sequence.
- Generation phase: flash decoding. One query per sequence, so one program per (sequence, KV head,
  split) holds the KV head's whole group of query heads as the rows of one tile (each page read
  once for the group), and the pages are split SPLITS ways so that batch-1 decode of a long context
  still fills the GPU (up to SPLITS, one per KEYS_PER_SPLIT keys of the batch's longest context);
  a second kernel merges the splits' partial softmaxes.

8-bit pools (INT8, FP8) store round/cast(x / kv_scale) and are widened times kv_scale as read.
Semantics are kiln/plugins/reference.py's: soft cap tanh(s / cap) * cap before the mask, a query
at p sees keys p - window < key <= p.
"""
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kiln.plugins.gpu import triton_op
from kiln.plugins.gpu.elementwise import _tanh

SPLITS = 16  # most decode splits per (sequence, KV head): 16 x 8 KV heads fill an H100 at batch 1
KEYS_PER_SPLIT = 128  # fewer splits for short contexts, where a split's fixed cost is most of its work
CONTEXT_ROWS = 64  # context rows per program (queries x their KV head's query heads), at least 16 queries
NEG = tl.constexpr(-1.0e30)  # a masked score: finite, so that a row with nothing to see stays 0 instead of NaN


@triton.jit
def _round_half_even(x):
    r = tl.floor(x)
    d = x - r
    odd = (r - 2 * tl.floor(r / 2)) != 0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1, r)


@triton.jit
def _e4m3_grid(x):
    """x (within +-448) rounded half-to-even onto float8_e4m3fn's values, so that the cast after is
    exact: Triton's interpreter rounds some values at a binade's edge to the binade below."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    return _round_half_even(x / step) * step


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, slot_ptr, kv_ptr, scale_ptr, layer, T, k_stride, v_stride, s_layer, s_kv,
                     block_size, W, QUANT: tl.constexpr, INT8: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slot_ptr + t, mask=t < T, other=0).to(tl.int64)
    dst = kv_ptr + layer * s_layer + (slot // block_size) * block_size * W + (slot % block_size) * W
    i = tl.arange(0, BLOCK)[None, :]
    m = (t < T)[:, None] & (i < W)
    k = tl.load(k_ptr + t[:, None] * k_stride + i, mask=m, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t[:, None] * v_stride + i, mask=m, other=0.0).to(tl.float32)
    if QUANT:
        inv = 1 / tl.load(scale_ptr).to(tl.float32)
        k, v = k * inv, v * inv
        if INT8:
            k = tl.minimum(tl.maximum(_round_half_even(k), -128.0), 127.0)
            v = tl.minimum(tl.maximum(_round_half_even(v), -128.0), 127.0)
        else:  # clamp before the cast: e4m3fn has no infinity to saturate to
            k, v = tl.minimum(tl.maximum(k, -448.0), 448.0), tl.minimum(tl.maximum(v, -448.0), 448.0)
            k, v = _e4m3_grid(k), _e4m3_grid(v)
    tl.store(dst[:, None] + i, k.to(kv_ptr.dtype.element_ty), mask=m)
    tl.store(dst[:, None] + s_kv + i, v.to(kv_ptr.dtype.element_ty), mask=m)


def _kv_write_fake(kv_cache, layer, k, v, slot_mapping, kv_scale=None):
    return None


@triton_op("kv_cache_write", _kv_write_fake, mutates_args=("kv_cache",))
def kv_cache_write(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_scale: Optional[torch.Tensor] = None) -> None:
    """k, v [T, KH, D] into the pool at each token's slot (block * block_size + offset)."""
    W = k.shape[1] * k.shape[2]
    k, v = k.reshape(k.shape[0], W), v.reshape(v.shape[0], W)  # views where the heads are dense
    T, block = k.shape[0], triton.next_power_of_2(W)
    rows = max(1, 4096 // block)
    wrap_triton(_kv_write_kernel)[(triton.cdiv(T, rows),)](
        k, v, slot_mapping, kv_cache, kv_cache if kv_scale is None else kv_scale, layer, T, k.stride(0), v.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.shape[3], W, QUANT=kv_scale is not None,
        INT8=kv_cache.dtype == torch.int8, ROWS=rows, BLOCK=block)


@triton.jit
def _scores(q, k, scale, softcap, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if SOFTCAP:
        s = _tanh(s / softcap) * softcap
    return s


@triton.jit
def _attend_tile(q, m_i, l_i, acc, kv_base, table_ptr, keys, lo, length, pos, d, dm, block_size, s_block, s_pos,
                 s_kv, kv_scale, scale, window, softcap, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """One step of the online softmax: the rows' queries (at positions pos) against keys."""
    kin = (keys >= lo) & (keys < length)
    block = tl.load(table_ptr + keys // block_size, mask=kin, other=0).to(tl.int64)
    addr = kv_base + block[:, None] * s_block + (keys % block_size)[:, None] * s_pos + d[None, :]
    kmask = kin[:, None] & dm[None, :]
    k = tl.load(addr, mask=kmask, other=0.0).to(tl.float32) * kv_scale
    v = tl.load(addr + s_kv, mask=kmask, other=0.0).to(tl.float32) * kv_scale
    sc = _scores(q, k, scale, softcap, SOFTCAP, PRECISION)
    seen = kin[None, :] & (keys[None, :] <= pos[:, None])
    if window > 0:
        seen = seen & (keys[None, :] > pos[:, None] - window)
    sc = tl.where(seen, sc, NEG)
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    p = tl.where(seen, tl.exp(sc - m_new[:, None]), 0.0)
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)


@triton.jit
def _count_valid(row_ptr, n, BLOCK: tl.constexpr):
    total = 0
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        total += tl.sum((tl.load(row_ptr + i, mask=i < n, other=-1) >= 0).to(tl.int32), axis=0)
    return total


@triton.jit
def _context_kernel(q_ptr, kv_ptr, scale_ptr, out_ptr, token_ptr, tables_ptr, lens_ptr, layer, heads, group,
                    q_stride_t, q_stride_h, s_layer, s_kv, s_block, s_pos, tok_stride, table_stride, block_size,
                    D, scale, window, softcap, QUANT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    s, kh, mb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = _count_valid(token_ptr + s * tok_stride, tok_stride, BLOCK_M)  # the chunk's queries: a prefix
    if mb * BLOCK_M < count:
        length = tl.load(lens_ptr + s)
        r = tl.arange(0, BLOCK_R)  # rows: BLOCK_M queries x the KV head's group of query heads
        query = mb * BLOCK_M + r // group
        valid = (r < BLOCK_M * group) & (query < count)
        h = kh * group + r % group
        tokens = tl.load(token_ptr + s * tok_stride + query, mask=valid, other=0)
        pos = length - count + query  # the chunk holds its sequence's last `count` positions
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        q = tl.load(q_ptr + tokens[:, None] * q_stride_t + h[:, None] * q_stride_h + d[None, :],
                    mask=valid[:, None] & dm[None, :], other=0.0).to(tl.float32)
        kv_scale = tl.load(scale_ptr).to(tl.float32) if QUANT else 1.0
        m_i = tl.full((BLOCK_R,), NEG, tl.float32)
        l_i = tl.zeros((BLOCK_R,), tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        end = tl.minimum(length - count + (mb + 1) * BLOCK_M, length)
        lo = 0
        if window > 0:
            lo = tl.maximum(length - count + mb * BLOCK_M - window + 1, 0)
        kv_base = kv_ptr + layer * s_layer + kh * D
        for start in range((lo // BLOCK_N) * BLOCK_N, end, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kv_base, tables_ptr + s * table_stride, keys, lo, end,
                                         pos, d, dm, block_size, s_block, s_pos, s_kv, kv_scale, scale, window,
                                         softcap, SOFTCAP, PRECISION)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        optr = out_ptr + tokens[:, None] * (heads * D) + h[:, None] * D + d[None, :]
        tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & dm[None, :])


@triton.jit
def _decode_kernel(q_ptr, kv_ptr, scale_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, token_ptr, tables_ptr, lens_ptr, layer,
                   heads, group, q_stride_t, q_stride_h, s_layer, s_kv, s_block, s_pos, table_stride, block_size,
                   D, scale, window, softcap, splits, QUANT: tl.constexpr, SOFTCAP: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    s, kh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lens_ptr + s)
    lo = 0
    if window > 0:
        lo = tl.maximum(length - window, 0)
    per_split = tl.cdiv(tl.cdiv(length - lo, splits), BLOCK_N) * BLOCK_N
    first = lo + split * per_split
    end = tl.minimum(first + per_split, length)
    g = tl.arange(0, BLOCK_G)
    heads_of = kh * group + g
    gm = g < group
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    token = tl.load(token_ptr + s)
    q = tl.load(q_ptr + token * q_stride_t + heads_of[:, None] * q_stride_h + d[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    kv_scale = tl.load(scale_ptr).to(tl.float32) if QUANT else 1.0
    m_i = tl.full((BLOCK_G,), NEG, tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    pos = tl.zeros((BLOCK_G,), tl.int32) + length - 1
    kv_base = kv_ptr + layer * s_layer + kh * D
    for start in range(first, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, kv_base, tables_ptr + s * table_stride, keys, first, end, pos,
                                     d, dm, block_size, s_block, s_pos, s_kv, kv_scale, scale, window, softcap, SOFTCAP,
                                     PRECISION)
    if splits == 1:  # the whole context in this program: the output itself, no merge
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        optr = out_ptr + token * (heads * D) + heads_of[:, None] * D + d[None, :]
        tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])
    else:
        row = (s * heads + heads_of) * splits + split  # partials [Sg, H, splits] (acc: times D)
        tl.store(m_ptr + row, m_i, mask=gm)
        tl.store(l_ptr + row, l_i, mask=gm)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gm[:, None] & dm[None, :])


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, token_ptr, out_ptr, heads, D, splits, SPLITS: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    s, h = tl.program_id(0), tl.program_id(1)
    if splits > 1:  # (one split: the decode kernel wrote the output)
        base = (s * heads + h) * splits
        i = tl.arange(0, SPLITS)
        im = i < splits
        d = tl.arange(0, BLOCK_D)
        m = tl.load(m_ptr + base + i, mask=im, other=NEG)
        l_split = tl.load(l_ptr + base + i, mask=im, other=0.0)
        w = tl.exp(m - tl.max(m, axis=0)) * (l_split > 0)  # empty splits weigh nothing
        l_sum = tl.sum(w * l_split, axis=0)
        acc = tl.load(acc_ptr + (base + i)[:, None] * D + d[None, :], mask=im[:, None] & (d[None, :] < D), other=0.0)
        o = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_sum > 0, l_sum, 1.0)
        token = tl.load(token_ptr + s)
        tl.store(out_ptr + token * (heads * D) + h * D + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


def _paged_attention_fake(q, kv_cache, layer, ctx_token_index, ctx_block_tables, ctx_context_lens, gen_token_index,
                          gen_block_tables, gen_context_lens, scale, kv_scale=None, window=0, softcap=0.0):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2])


@triton_op("paged_attention", _paged_attention_fake)
def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, ctx_token_index: torch.Tensor,
                    ctx_block_tables: torch.Tensor, ctx_context_lens: torch.Tensor, gen_token_index: torch.Tensor,
                    gen_block_tables: torch.Tensor, gen_context_lens: torch.Tensor, scale: float,
                    kv_scale: Optional[torch.Tensor] = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [T, H, D] (strided heads allowed) -> [T, H, D]; the arguments are kiln.plugins.cpu's."""
    T, H, D = q.shape
    KH, block_size = kv_cache.shape[4], kv_cache.shape[3]
    group = H // KH
    out = q.new_empty(T, H, D)
    quant = kv_scale is not None
    scale_arg = kv_scale if quant else kv_cache
    strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
    block_d = max(16, triton.next_power_of_2(D))
    # float32 models: exact products (a float32 engine is the HF-parity reference); 16-bit ones: TF32,
    # exact for their q and k, and for the probabilities finer than the 16-bit p flash attention uses
    common = dict(QUANT=quant, SOFTCAP=bool(softcap), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                  BLOCK_N=32, BLOCK_D=block_d)
    Sc, Q = ctx_token_index.shape
    block_m = max(16, CONTEXT_ROWS // group)
    wrap_triton(_context_kernel)[(Sc, KH, triton.cdiv(Q, block_m))](
        q, kv_cache, scale_arg, out, ctx_token_index, ctx_block_tables, ctx_context_lens, layer, H, group,
        q.stride(0), q.stride(1), *strides, Q, ctx_block_tables.stride(0), block_size, D, scale, window, softcap,
        BLOCK_M=block_m, BLOCK_R=triton.next_power_of_2(block_m * group), **common)
    Sg, width = gen_block_tables.shape
    # From shapes alone (no device sync): the block tables' width bounds the batch's longest context
    splits = min(SPLITS, triton.cdiv(width * block_size, KEYS_PER_SPLIT))
    m = q.new_empty(Sg, H, splits, dtype=torch.float32)
    l_sum = torch.empty_like(m)
    acc = q.new_empty(Sg, H, splits, D, dtype=torch.float32)
    wrap_triton(_decode_kernel)[(Sg, KH, splits)](
        q, kv_cache, scale_arg, m, l_sum, acc, out, gen_token_index, gen_block_tables, gen_context_lens, layer, H,
        group, q.stride(0), q.stride(1), *strides, gen_block_tables.stride(0), block_size, D, scale, window, softcap,
        splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), **common)
    wrap_triton(_merge_kernel)[(Sg, H)](m, l_sum, acc, gen_token_index, out, H, D, splits, SPLITS=SPLITS,
                                        BLOCK_D=triton.next_power_of_2(D))
    return out
