"""RMSNorm (alone, with the residual add, per head), rotary embedding and the gated activations.

One program per row (a token, or a token's head), the whole row in one block: these ops are
bandwidth bound, and a row of a decoder (hidden size up to 16k) fits one block's registers. Rows
are read through their strides, so a q/k head view of the fused QKV output is normed and rotated
where it lies, with no copy first. Semantics are kiln/plugins/reference.py's.
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


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, heads, stride_t, stride_h, res_stride,
                     D, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t, h = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + t * stride_t + h * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # the residual stream is kept in the model dtype, as HF keeps it: round before the norm
        r = x + tl.load(res_ptr + t * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        r = r.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * D + cols, r, mask=mask)
        x = r.to(tl.float32)
    inv = 1 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor):
    """(rows, heads, stride of a token, stride of a head) of x [..., D] (2-D or 3-D, last dim dense)."""
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
    wrap_triton(_rms_norm_kernel)[(rows,)](x, x, weight, out, out, heads, stride_t, stride_h, 0, D, eps,
                                           ADD=False, BLOCK=triton.next_power_of_2(D))
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
    wrap_triton(_rms_norm_kernel)[(T,)](x, residual, weight, out, res_out, 1, D, 0, D, D, eps,
                                        ADD=True, BLOCK=triton.next_power_of_2(D))
    return out, res_out


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_t, stride_h, D, HALF,
                   BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    t, h = row // heads, row % heads
    src, dst = x_ptr + t * stride_t + h * stride_h, out_ptr + row * D
    i = tl.arange(0, BLOCK_HALF)
    m = i < HALF
    c = tl.load(cos_ptr + t * HALF + i, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * HALF + i, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + i, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF + i, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=m)
    j = 2 * HALF + tl.arange(0, BLOCK_D)  # partial rotary: the rest passes through
    tl.store(dst + j, tl.load(src + j, mask=j < D, other=0.0), mask=j < D)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x, rows, heads, stride_t, stride_h = _rows(x)
    out = x.new_empty(x.shape)
    half, D = cos.shape[-1], x.shape[-1]
    wrap_triton(_rotary_kernel)[(rows,)](x, cos.contiguous(), sin.contiguous(), out, heads, stride_t, stride_h, D,
                                         half, BLOCK_HALF=triton.next_power_of_2(half),
                                         BLOCK_D=triton.next_power_of_2(max(D - 2 * half, 1)))
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
def _gated_kernel(x_ptr, out_ptr, stride_t, N, GELU: tl.constexpr, BLOCK: tl.constexpr):
    t, b = tl.program_id(0), tl.program_id(1)
    i = b * BLOCK + tl.arange(0, BLOCK)
    m = i < N
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
    wrap_triton(_gated_kernel)[(T, triton.cdiv(N, block))](x, out, x.stride(0), N, GELU=gelu, BLOCK=block)
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
