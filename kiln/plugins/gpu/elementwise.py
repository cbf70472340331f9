"""RMSNorm (alone, with the residual add, per head), rotary embedding and the gated activations.

Each program takes whole rows (tokens, or a token's heads), TILE elements' worth: these ops are
bandwidth bound, a decoder's row (hidden size up to 16k) fits one program's registers, and short
rows (64-wide heads) are packed several to a program rather than left to launch one each. Rows are
read through their strides, so a q/k head view of the fused QKV output is normed and rotated where
it lies, with no copy first. Semantics are kiln/plugins/reference.py's.
"""
import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kiln.plugins.gpu import triton_op


@triton.jit
def _tanh(x):
    # tanh from exp: the interpreter and every GPU target have exp; libdevice's tanh is CUDA only
    return 2 * tl.sigmoid(2 * x) - 1


TILE = 4096  # elements per program: several short rows in one (a 64-wide head norm), one row of 4096


def _rows_per_program(width: int) -> int:
    return max(1, TILE // triton.next_power_of_2(width))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rows, heads, stride_t, stride_h, res_stride,
                     D, eps, ADD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    t, h = row // heads, row % heads
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (cols < D)
    x = tl.load(x_ptr + t * stride_t + h * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # the residual stream is kept in the model dtype, as HF keeps it: round before the norm
        r = x + tl.load(res_ptr + t * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        r = r.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * D + cols, r, mask=mask)
        x = r.to(tl.float32)
    inv = 1 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (x * inv[:, None] * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor):
    """(x, rows, heads, stride of a token, stride of a head) of x [T, D] or [T, H, D], its last dim dense."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0
    return x, x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def _norm_fake(x, weight, eps):
    return x.new_empty(x.shape)


@triton_op("rms_norm", _norm_fake)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] or [T, H, D] (each head normed: Qwen3's and Gemma 3's q/k norms)."""
    x, rows, heads, stride_t, stride_h = _rows(x)
    out = x.new_empty(x.shape)
    D = x.shape[-1]
    per = _rows_per_program(D)
    wrap_triton(_rms_norm_kernel)[(triton.cdiv(rows, per),)](
        x, x, weight, out, out, rows, heads, stride_t, stride_h, 0, D, eps, ADD=False, ROWS=per,
        BLOCK=triton.next_power_of_2(D))
    return out


def _add_norm_fake(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@triton_op("fused_add_rms_norm", _add_norm_fake)
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), x [T, D]."""
    x, residual = x.contiguous(), residual.contiguous()
    out, res_out = x.new_empty(x.shape), x.new_empty(x.shape)
    T, D = x.shape
    per = _rows_per_program(D)
    wrap_triton(_rms_norm_kernel)[(triton.cdiv(T, per),)](
        x, residual, weight, out, res_out, T, 1, D, 0, D, D, eps, ADD=True, ROWS=per,
        BLOCK=triton.next_power_of_2(D))
    return out, res_out


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, rows, heads, stride_t, stride_h, D, HALF,
                   ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # rows: (token, head)
    t, h = row // heads, row % heads
    i = tl.arange(0, BLOCK_HALF)[None, :]
    m = (row < rows) & (i < HALF)
    src, dst = x_ptr + t * stride_t + h * stride_h, out_ptr + row * D
    c = tl.load(cos_ptr + t * HALF + i, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * HALF + i, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + i, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF + i, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=m)
    j = 2 * HALF + tl.arange(0, BLOCK_D)[None, :]  # partial rotary: the rest passes through
    rest = (row < rows) & (j < D)
    tl.store(dst + j, tl.load(src + j, mask=rest, other=0.0), mask=rest)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x, rows, heads, stride_t, stride_h = _rows(x)
    out = x.new_empty(x.shape)
    half, D = cos.shape[-1], x.shape[-1]
    per = _rows_per_program(D)
    wrap_triton(_rotary_kernel)[(triton.cdiv(rows, per),)](
        x, cos.contiguous(), sin.contiguous(), out, rows, heads, stride_t, stride_h, D, half, ROWS=per,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(max(D - 2 * half, 1)))
    return out


def _rotary_fake(q, k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@triton_op("rotary_embedding", _rotary_fake)
def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-NeoX rotation of the first 2 * cos.shape[-1] dims of q [T, H, D] and k [T, KH, D];
    cos/sin [T, D_rot / 2] (the model's tables: llama3, yarn, LongRoPE are in their values)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@triton.jit
def _gated_kernel(x_ptr, out_ptr, T, stride_t, N, GELU: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    m = (t < T) & (i < N)
    gate = tl.load(x_ptr + t * stride_t + i, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_t + N + i, mask=m, other=0.0).to(tl.float32)
    if GELU:  # tanh approximation (gelu_pytorch_tanh)
        act = 0.5 * gate * (1 + _tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
    else:
        act = gate * tl.sigmoid(gate)
    tl.store(out_ptr + t * N + i, (act * up).to(out_ptr.dtype.element_ty), mask=m)


def _gated(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    x = x.contiguous()
    T, N = x.shape[0], x.shape[1] // 2
    out = x.new_empty(T, N)
    block = min(1024, triton.next_power_of_2(N))
    per = _rows_per_program(block)
    wrap_triton(_gated_kernel)[(triton.cdiv(T, per), triton.cdiv(N, block))](x, out, T, x.stride(0), N, GELU=gelu,
                                                                              ROWS=per, BLOCK=block)
    return out


def _gated_fake(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@triton_op("silu_and_mul", _gated_fake)
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :N]) * x[:, N:] of x [T, 2N]."""
    return _gated(x, False)


@triton_op("gelu_tanh_and_mul", _gated_fake)
def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x[:, :N]) * x[:, N:] (Gemma's GeGLU)."""
    return _gated(x, True)
