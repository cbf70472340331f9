"""Fused mixture-of-experts experts (vLLM's fused_moe): one grouped GEMM launch per projection.

A step's (token, expert) pairs are sorted by expert into blocks of BLOCK_M, each expert's padded to
a whole number of blocks (`align`), on the device with torch ops and no host sync: the number of
blocks is bounded by the shapes alone (pairs + experts * (BLOCK_M - 1)), and blocks past the used
ones carry expert -1 and exit at once. A program of the grouped GEMM then multiplies one block of
pairs, all of one expert, by a tile of that expert's rows, so every chosen expert's weights are read
once per block of its tokens whatever the mix, where a per-expert loop would launch (or sync) per
expert. The first GEMM (fc, rows [gate; up]) applies SiLU(gate) * up in its epilogue; the second
(proj) multiplies by the pair's routing weight in its own, and the top-k rows of a token are summed
in float32. Pairs whose expert another rank holds are never computed (their rows stay zero).

W8A16 experts keep int8 weights with one scale per output channel: a channel's scale factors out of
its dot products, so the epilogue applies it to the float32 accumulator, exactly what dequantizing
every tile would give. Tiles are widened to float32 before tl.dot (the interpreter has no 16-bit
arithmetic): "ieee" products for float32 models, tf32 ones for 16-bit models, whose values (and
int8's) tf32 holds exactly.
"""
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kiln.config import ConfigError
from kiln.plugins.gpu import interpreted, triton_op

BLOCK_M = 16  # pairs per block: small, as decode steps (few tokens per expert) are the common case


def align(ids: torch.Tensor, groups: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by group (expert, LoRA slot) into blocks of block_m, each group's padded.

    ids: [n] group of each pair, those outside 0 .. groups - 1 dropped. Returns (sorted_ids [P]: the
    pair at each place, n where padding; block_groups [P / block_m]: each block's group, -1 past the
    used blocks), P = cdiv(n + groups * (block_m - 1), block_m) * block_m.
    """
    n, device = ids.numel(), ids.device
    ids = ids.reshape(-1).to(torch.int64)
    key = torch.where((ids >= 0) & (ids < groups), ids, groups)  # dropped pairs sort last
    # scatter_add, not bincount: CUDA's bincount reads the max to size its output (a host sync)
    counts = torch.zeros(groups + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:groups] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    first = torch.cumsum(counts, 0) - counts  # each group's first place in `order`
    starts = torch.cat([ends - padded, ends.new_zeros(1)])
    places = triton.cdiv(n + groups * (block_m - 1), block_m) * block_m
    pos = starts[sorted_key] + torch.arange(n, device=device) - first[sorted_key]
    pos = torch.where(sorted_key < groups, pos, places)  # dropped pairs land past the end, sliced off
    sorted_ids = torch.full((places + 1,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    block_start = torch.arange(0, places, block_m, device=device)
    group = torch.searchsorted(ends, block_start, right=True)
    return sorted_ids[:places], torch.where(group < groups, group, -1).to(torch.int32)


@triton.jit
def _expert_gemm(a_ptr, w_ptr, scale_ptr, out_ptr, sorted_ptr, block_expert_ptr, routing_ptr,
                 num_pairs, N, K, stride_a, stride_we, stride_wn, stride_se, stride_out,
                 A_DIV: tl.constexpr, GATED: tl.constexpr, SCALED: tl.constexpr, ROUTED: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n] for one block of pairs of one expert: rows of `a` at pair // A_DIV (a token's x
    for fc, the pair's own activation for proj); GATED: SiLU(a . w[n]) * (a . w[N + n])."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pairs < num_pairs
    rows = tl.where(row_ok, pairs // A_DIV, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0).to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            u = tl.load(w_base + (N + offs_n)[None, :] * stride_wn + ks[:, None], mask=w_mask,
                        other=0.0).to(tl.float32)
            acc_up = tl.dot(a, u, acc_up, input_precision=PRECISION)
    if SCALED:
        s_base = scale_ptr + expert * stride_se
        acc = acc * tl.load(s_base + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(s_base + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if ROUTED:
        acc = acc * tl.load(routing_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


def _blocks(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): wide tiles on a GPU; under the interpreter, one tile spans a tiny test's dims."""
    if interpreted():
        return min(64, max(16, triton.next_power_of_2(n))), min(64, max(16, triton.next_power_of_2(k)))
    return 64, 64


def _check(x, topk_ids, topk_weights, w_fc, w_proj, fc_scale, proj_scale) -> None:
    if x.dim() != 2 or w_fc.dim() != 3 or w_proj.dim() != 3:
        raise ConfigError(f"fused_moe: x must be [T, hidden] and w_fc / w_proj [experts, out, in], got "
                          f"{tuple(x.shape)}, {tuple(w_fc.shape)}, {tuple(w_proj.shape)}")
    (T, H), (E, I2, _), I = x.shape, w_fc.shape, w_proj.shape[2]
    if tuple(w_fc.shape) != (E, 2 * I, H) or tuple(w_proj.shape) != (E, H, I):
        raise ConfigError(f"fused_moe: w_fc must be [experts, 2 * inter, hidden] and w_proj [experts, hidden, "
                          f"inter] for x of hidden {H}, got {tuple(w_fc.shape)} and {tuple(w_proj.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ConfigError(f"fused_moe: topk_ids and topk_weights must both be [T, top_k] = [{T}, k], got "
                          f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype.is_floating_point:
        raise ConfigError(f"fused_moe: topk_ids must be integers, got {topk_ids.dtype}")
    quantized = w_fc.dtype == torch.int8
    if quantized != (w_proj.dtype == torch.int8) or quantized != (fc_scale is not None) \
            or quantized != (proj_scale is not None):
        raise ConfigError("fused_moe: expected unquantized w_fc and w_proj without scales, or int8 ones (W8A16) with "
                          f"fc_scale [experts, 2 * inter] and proj_scale [experts, hidden]; got {w_fc.dtype} and "
                          f"{w_proj.dtype} with scales {fc_scale is not None} and {proj_scale is not None}")
    if quantized and (tuple(fc_scale.shape) != (E, I2) or tuple(proj_scale.shape) != (E, H)):
        raise ConfigError(f"fused_moe: per-channel scales must be [{E}, {I2}] and [{E}, {H}], got "
                          f"{tuple(fc_scale.shape)} and {tuple(proj_scale.shape)}")
    if not quantized and (w_fc.dtype != x.dtype or w_proj.dtype != x.dtype):
        raise ConfigError(f"fused_moe: unquantized experts must be x's dtype {x.dtype}, got {w_fc.dtype} and "
                          f"{w_proj.dtype}")


def _fused_moe_fake(x, topk_ids, topk_weights, w_fc, w_proj, fc_scale=None, proj_scale=None, expert_start=0):
    return x.new_empty(x.shape)


@triton_op("fused_moe", _fused_moe_fake)
def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_fc: torch.Tensor,
              w_proj: torch.Tensor, fc_scale: Optional[torch.Tensor] = None,
              proj_scale: Optional[torch.Tensor] = None, expert_start: int = 0) -> torch.Tensor:
    """sum over each token's top-k experts e of weight * proj_e(SiLU(gate_e x) * up_e x).

    x [T, hidden]; topk_ids, topk_weights [T, k] (global expert ids; those outside expert_start ..
    expert_start + experts - 1 are another rank's and skipped); w_fc [experts, 2 * inter, hidden]
    rows gate first, w_proj [experts, hidden, inter], x's dtype, or int8 with per-channel scales
    fc_scale [experts, 2 * inter], proj_scale [experts, hidden]. Returns [T, hidden] in x's dtype.
    """
    _check(x, topk_ids, topk_weights, w_fc, w_proj, fc_scale, proj_scale)
    x, w_fc, w_proj = x.contiguous(), w_fc.contiguous(), w_proj.contiguous()
    (T, H), (E, I2, _), k = x.shape, w_fc.shape, topk_ids.shape[1]
    inter, pairs = I2 // 2, T * k
    sorted_ids, block_experts = align(topk_ids.reshape(-1) - expert_start, E, BLOCK_M)
    routing = topk_weights.reshape(-1).contiguous()
    scaled = fc_scale is not None
    fc_s = fc_scale.contiguous() if scaled else x
    proj_s = proj_scale.contiguous() if scaled else x
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    blocks = block_experts.shape[0]

    act = x.new_empty(pairs, inter)  # SiLU(gate) * up per pair, rounded to the model dtype as HF's
    bn, bk = _blocks(inter, H)
    wrap_triton(_expert_gemm)[(blocks, triton.cdiv(inter, bn))](
        x, w_fc, fc_s, act, sorted_ids, block_experts, routing, pairs, inter, H, x.stride(0), w_fc.stride(0),
        w_fc.stride(1), fc_s.stride(0) if scaled else 0, act.stride(0), A_DIV=k, GATED=True, SCALED=scaled,
        ROUTED=False, PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk)
    out = x.new_zeros(pairs, H)  # zero rows: pairs of another rank's experts
    bn, bk = _blocks(H, inter)
    wrap_triton(_expert_gemm)[(blocks, triton.cdiv(H, bn))](
        act, w_proj, proj_s, out, sorted_ids, block_experts, routing, pairs, H, inter, act.stride(0),
        w_proj.stride(0), w_proj.stride(1), proj_s.stride(0) if scaled else 0, out.stride(0), A_DIV=1,
        GATED=False, SCALED=scaled, ROUTED=True, PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk)
    return out.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)
