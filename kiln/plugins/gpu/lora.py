"""LoRA's per-token updates as punica's (S-LoRA, vLLM) shrink and expand kernels.

A step's tokens are sorted by adapter slot once (`TritonAdapters`, with the fused MoE's `align`:
blocks of BLOCK_M tokens of one slot, no host sync), as vLLM's punica kernels take a step's
metadata; every adapted linear of every layer reuses that order. `lora_shrink` then computes, per
block, its tokens' x . A_s^T over the slot's rank (a tl.dot of the gathered token rows by A's rows),
and `lora_expand` adds shrunk . B_s to the linear's output at the module's columns. Only a token's
own adapter is read, over its own rank (a rank-8 adapter in an engine built for 64 costs rank 8),
and tokens of the base model (slot -1) are never touched. Semantics are kiln/models/lora.py's
(`StepAdapters`, `delta`: the pool layout, alpha / r folded into B); the shrunk activations stay
float32 between the two kernels.
"""
import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kiln.config import ConfigError
from kiln.plugins.gpu import triton_op
from kiln.plugins.gpu.moe import align

BLOCK_M = 16  # tokens per block


@triton.jit
def _shrink_kernel(x_ptr, pool_ptr, ranks_ptr, sorted_ptr, block_slot_ptr, out_ptr, T, K, R,
                   stride_x, stride_ps, stride_pr, stride_out, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_r = tl.program_id(0), tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    slot = slot.to(tl.int64)
    rank = tl.load(ranks_ptr + slot)
    if pid_r * BLOCK_R >= rank:  # past the adapter's rank: the output's zeros stand
        return
    tokens = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ok = tokens < T
    rows = tl.where(ok, tokens, 0)
    rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = (rs < rank) & (rs < R)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = pool_ptr + slot * stride_ps
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        a = tl.load(a_base + rs[None, :] * stride_pr + ks[:, None], mask=k_ok[:, None] & r_ok[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.dot(x, a, acc, input_precision=PRECISION)
    tl.store(out_ptr + tokens[:, None] * stride_out + rs[None, :], acc, mask=ok[:, None] & (rs < R)[None, :])


@triton.jit
def _expand_kernel(shrunk_ptr, pool_ptr, ranks_ptr, sorted_ptr, block_slot_ptr, out_ptr, T, N, R, in_features,
                   column, stride_s, stride_ps, stride_pr, stride_out, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    slot = slot.to(tl.int64)
    rank = tl.minimum(tl.load(ranks_ptr + slot), R)
    if rank <= 0:
        return
    tokens = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ok = tokens < T
    rows = tl.where(ok, tokens, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    b_base = pool_ptr + slot * stride_ps + in_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        s = tl.load(shrunk_ptr + rows[:, None] * stride_s + rs[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_base + rs[:, None] * stride_pr + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.dot(s, b, acc, input_precision=PRECISION)
    ptrs = out_ptr + tokens[:, None] * stride_out + column + offs_n[None, :]
    mask = ok[:, None] & n_ok[None, :]
    cur = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (cur + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _rank_block(R: int) -> int:
    return min(64, max(16, triton.next_power_of_2(R)))  # tl.dot's dims are >= 16


def _precision(pool: torch.Tensor) -> str:
    # expand's shrunk operand is float32: tf32 rounds it less than the reference's 16-bit GEMM does
    return "ieee" if pool.dtype == torch.float32 else "tf32"


def _check(x_shape, pool, ranks, sorted_tokens, block_slots, what: str) -> None:
    """x_shape: [T, in] of the linear's input."""
    if len(x_shape) != 2 or pool.dim() != 3 or pool.shape[2] <= x_shape[1]:
        raise ConfigError(f"{what}: x must be [T, in] and the pool one layer's [slots, max_rank, in + out], got "
                          f"{tuple(x_shape)} and {tuple(pool.shape)}")
    if ranks.dim() != 1 or ranks.shape[0] != pool.shape[0] or ranks.dtype.is_floating_point:
        raise ConfigError(f"{what}: lora_ranks must be integers [slots] = [{pool.shape[0]}], got "
                          f"{tuple(ranks.shape)} {ranks.dtype}")
    if sorted_tokens.dim() != 1 or block_slots.dim() != 1 or sorted_tokens.shape[0] != block_slots.shape[0] * BLOCK_M:
        raise ConfigError(f"{what}: sorted_tokens and block_slots must be align(lora_slots, slots, {BLOCK_M})'s, "
                          f"got {tuple(sorted_tokens.shape)} and {tuple(block_slots.shape)}")


def _shrink_fake(x, pool, ranks, sorted_tokens, block_slots):
    return x.new_empty((x.shape[0], pool.shape[1]), dtype=torch.float32)


@triton_op("lora_shrink", _shrink_fake)
def lora_shrink(x: torch.Tensor, pool: torch.Tensor, ranks: torch.Tensor, sorted_tokens: torch.Tensor,
                block_slots: torch.Tensor) -> torch.Tensor:
    """[T, max_rank] float32: each token's A_s x over its slot's rank (zero past it and for slot -1).
    x [T, in]; pool [slots, max_rank, in + out]; ranks [slots]; the tokens' `align` by slot."""
    _check(x.shape, pool, ranks, sorted_tokens, block_slots, "lora_shrink")
    T, K = x.shape
    R = pool.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    pool = pool.contiguous()
    out = x.new_zeros((T, R), dtype=torch.float32)
    br, bk = _rank_block(R), min(64, max(16, triton.next_power_of_2(K)))
    wrap_triton(_shrink_kernel)[(block_slots.shape[0], triton.cdiv(R, br))](
        x, pool, ranks, sorted_tokens, block_slots, out, T, K, R, x.stride(0), pool.stride(0), pool.stride(1),
        out.stride(0), PRECISION=_precision(pool), BLOCK_M=BLOCK_M, BLOCK_R=br, BLOCK_K=bk)
    return out


def _expand_fake(out, shrunk, pool, ranks, sorted_tokens, block_slots, in_features, column):
    return None


@triton_op("lora_expand", _expand_fake, mutates_args={"out"})
def lora_expand(out: torch.Tensor, shrunk: torch.Tensor, pool: torch.Tensor, ranks: torch.Tensor,
                sorted_tokens: torch.Tensor, block_slots: torch.Tensor, in_features: int, column: int) -> None:
    """out[:, column:column + out_p] += shrunk . B_s per token, in place; out_p = pool.shape[2] - in_features,
    shrunk lora_shrink's [T, max_rank] float32."""
    if out.dim() != 2:
        raise ConfigError(f"lora_expand: out must be [T, N], got {tuple(out.shape)}")
    _check((out.shape[0], in_features), pool, ranks, sorted_tokens, block_slots, "lora_expand")
    (T, W), (_, R, cols) = out.shape, pool.shape
    N = cols - in_features
    if out.stride(-1) != 1 or tuple(shrunk.shape) != (T, R) or shrunk.dtype != torch.float32:
        raise ConfigError(f"lora_expand: out must be [T, N] with dense rows and shrunk lora_shrink's float32 "
                          f"[{T}, {R}], got out strides {out.stride()} and shrunk {tuple(shrunk.shape)} {shrunk.dtype}")
    if not 0 <= column <= W - N:
        raise ConfigError(f"lora_expand: the pool's {N} outputs at column {column} do not fit out's {W} columns")
    pool, shrunk = pool.contiguous(), shrunk.contiguous()
    bn, br = min(64, max(16, triton.next_power_of_2(N))), _rank_block(R)
    wrap_triton(_expand_kernel)[(block_slots.shape[0], triton.cdiv(N, bn))](
        shrunk, pool, ranks, sorted_tokens, block_slots, out, T, N, R, in_features, column, shrunk.stride(0),
        pool.stride(0), pool.stride(1), out.stride(0), PRECISION=_precision(pool), BLOCK_M=BLOCK_M, BLOCK_N=bn,
        BLOCK_R=br)


class TritonAdapters:
    """One step's LoRA updates on the kernels above, with StepAdapters' contract (kiln/models/lora.py):
    `self(i, out, x, (module, column), ...)` is out plus the listed modules' updates of layer i, at
    their columns; out itself is left as it was."""

    def __init__(self, slots: torch.Tensor, ranks: torch.Tensor, pools: dict):
        if not pools:
            raise ConfigError("TritonAdapters: expected at least one module's pool, got none")
        pool = next(iter(pools.values()))
        if slots.dim() != 1 or slots.dtype.is_floating_point:
            raise ConfigError(f"TritonAdapters: lora_slots must be integers [T], got {tuple(slots.shape)} "
                              f"{slots.dtype}")
        self.ranks, self.pools = ranks, pools
        self.sorted_tokens, self.block_slots = align(slots, pool.shape[1], BLOCK_M)

    def __call__(self, i: int, out: torch.Tensor, x: torch.Tensor, *columns: tuple[str, int]) -> torch.Tensor:
        present = [(self.pools[m][i], c) for m, c in columns if m in self.pools]
        if not present:
            return out
        out = out.clone(memory_format=torch.contiguous_format)
        for pool, c in present:
            shrunk = lora_shrink(x, pool, self.ranks, self.sorted_tokens, self.block_slots)
            lora_expand(out, shrunk, pool, self.ranks, self.sorted_tokens, self.block_slots, x.shape[-1], c)
        return out
