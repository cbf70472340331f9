"""Weight-only GEMMs (int8 per channel, int4 per group) in Triton, and the FP8 GEMM on torch._scaled_mm.

Each Triton program computes one [BLOCK_M, BLOCK_N] tile of y = x @ W^T, looping over K in BLOCK_K
steps: it loads a tile of x in its own dtype and a tile of stored weights, widens the weights in
registers and multiplies on `tl.dot` into a float32 accumulator. Tiles are ordered in groups of
GROUP_M rows so that programs running together share weight tiles in L2.

Why the scales wait for the epilogue: int8 and int4 values are exact in bf16/fp16, so on a GPU the
tile's dot runs on the tensor cores with x as it is and the weight's integers (no rounding of
q * scale to 16 bits, which a dequantize-then-dot kernel would add), and the float32 accumulator
keeps K-long sums of bf16 products (each exact in float32) to float32 precision: the sums the
interpreter's all-float32 path computes. A per-channel scale then multiplies the
finished sum once per output; a per-group scale multiplies each K step's partial sum (BLOCK_K
divides the group, so a step lies in one group). float32 inputs multiply in full precision
("ieee", not tf32): a float32 model asks for float32 results. Under Triton's interpreter (CI's
CPU run) both operands are widened to float32 first: it has no bfloat16 arithmetic.

int4 layout, converted once at build time by pack_int4 from ModelOpt's (two nibbles per byte
along the *output* dim, two's complement): packed [N, K/2] uint8, byte[n, j] = u[n, 2j] | u[n, 2j+1]
<< 4 with u = q + 8 (offset binary: decoding is a mask, a shift and a subtract); scales [K/g, N]
float32. Packing along K puts a program's K step for one output column in one contiguous run of
bytes, and a K step's scales for the tile's columns in one contiguous row.

Block sizes: BLOCK_M follows the token count where it is known (decode: 16-row tiles, the
smallest tl.dot takes; long prefills: 128 x 128 tiles); under export with a dynamic token count,
where branching on it would add a guard, one general 64 x 128 tile. Weights (and packed int4) are
read as contiguous rows, as the layers build them. Not here yet: split-K for decode on wide K.
"""
import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.library import wrap_triton

from kiln.config import ConfigError
from kiln.plugins import quant
from kiln.plugins.gpu import interpreted, triton_op

GROUP_SIZES = (32, 64, 128, 256)
GROUP_M = 8


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """(tile row, tile column) of this program, GROUP tile rows at a time (L2 reuse of W)."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP * grid_n
    first_m = (pid // width) * GROUP
    rows = tl.minimum(grid_m - first_m, GROUP)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.jit
def _dot(x, w, FP32_DOT: tl.constexpr):
    """x [BM, BK] @ w [BK, BN] (integers) in float32, on tensor cores in x's dtype where it is 16-bit."""
    if FP32_DOT:
        y = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        y = tl.dot(x, w.to(x.dtype))
    return y


@triton.jit
def _epilogue(acc, bias_ptr, out_ptr, rm, rn, M, N, HAS_BIAS: tl.constexpr):
    n_in = rn < N
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=n_in, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & n_in[None, :])


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                  HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]  # W^T's tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = k0 + rk < K
        x = tl.load(x_ptrs, mask=(rm[:, None] < M) & k_in[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=(rn[None, :] < N) & k_in[:, None], other=0)
        acc += _dot(x, w, FP32_DOT)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(scale_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    _epilogue(acc, bias_ptr, out_ptr, rm, rn, M, N, HAS_BIAS)


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, scale_ptr, pqs_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, group_size,
                  HAS_PQS: tl.constexpr, HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rb = tl.arange(0, BLOCK_K // 2)
    m_in, n_in = rm < M, rn < N
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * (K // 2) + rb[None, :]  # [BLOCK_N, BLOCK_K / 2] bytes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a whole number of groups, so of BLOCK_K: no K mask
        x = tl.load(x_ptrs, mask=m_in[:, None], other=0.0)
        if HAS_PQS:  # AWQ's smoothing, rounded to x's dtype as the unfused x * pqs would be
            p = tl.load(pqs_ptr + k0 + rk).to(tl.float32)
            x = (x.to(tl.float32) * p[None, :]).to(x_ptr.dtype.element_ty)
        b = tl.load(w_ptrs, mask=n_in[:, None], other=0).to(tl.int32)
        q = tl.join((b & 0xF) - 8, (b >> 4) - 8)  # [BLOCK_N, BLOCK_K / 2, 2]: k = 2j, 2j + 1
        q = tl.trans(tl.reshape(q, (BLOCK_N, BLOCK_K)))
        s = tl.load(scale_ptr + (k0 // group_size) * N + rn, mask=n_in, other=0.0).to(tl.float32)
        acc += _dot(x, q, FP32_DOT) * s[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
    _epilogue(acc, bias_ptr, out_ptr, rm, rn, M, N, HAS_BIAS)


def _rows(x: torch.Tensor, k: int):
    """x [..., K] as a 2-D [M, K] view with a dense last dim."""
    if x.shape[-1] != k:
        raise ConfigError(f"GEMM input has {x.shape[-1]} features; the weight expects {k}")
    x = x.reshape(-1, k)
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(M: int, N: int, block_k: int, x: torch.Tensor):
    """(grid, constexpr kwargs) for an [M, N] output."""
    if statically_known_true(M <= 16):
        bm, bn, warps = 16, 64, 4
    elif statically_known_true(M <= 32):
        bm, bn, warps = 32, 64, 4
    elif statically_known_true(M <= 64):
        bm, bn, warps = 64, 64, 4
    elif statically_known_true(M >= 256):
        bm, bn, warps = 128, 128, 8
    else:  # a dynamic token count (export), or a mid-sized one
        bm, bn, warps = 64, 128, 4
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    meta = dict(FP32_DOT=interpreted() or x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k,
                GROUP=GROUP_M, num_warps=warps, num_stages=3)
    return grid, meta


def _out_fake(x, weight, *args):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@triton_op("w8a16", _out_fake)
def w8a16(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (weight int8 [N, K] * scale [N])^T + bias [N] -> [..., N] in x's dtype."""
    N, K = weight.shape
    x2 = _rows(x, K)
    out = x.new_empty(x2.shape[0], N)
    grid, meta = _launch(x2.shape[0], N, 64, x)
    wrap_triton(_w8a16_kernel)[grid](x2, weight, scale, out if bias is None else bias, out, x2.shape[0], N, K,
                                     x2.stride(0), weight.stride(0), HAS_BIAS=bias is not None, **meta)
    return out.view(*x.shape[:-1], N)


def check_group_size(group_size: int, k: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"int4 group_size {group_size} is not supported; expected one of "
                          f"{', '.join(map(str, GROUP_SIZES))}")
    if k % group_size:
        raise ConfigError(f"int4 group_size {group_size} does not divide the input dim ({k})")


@triton_op("w4a16", _out_fake)
def w4a16(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int,
          bias: torch.Tensor | None = None, pre_quant_scale: torch.Tensor | None = None) -> torch.Tensor:
    """(x * pre_quant_scale) [..., K] @ W^T + bias -> [..., N] in x's dtype; packed [N, K/2] uint8 and
    scales [K/g, N] from pack_int4."""
    N, K = packed.shape[0], packed.shape[1] * 2
    check_group_size(group_size, K)
    if tuple(scales.shape) != (K // group_size, N):
        raise ConfigError(f"int4 scales have shape {tuple(scales.shape)}; expected [K / group_size, N] = "
                          f"[{K // group_size}, {N}] (pack_int4's layout)")
    x2 = _rows(x, K)
    out = x.new_empty(x2.shape[0], N)
    grid, meta = _launch(x2.shape[0], N, min(group_size, 64), x)
    wrap_triton(_w4a16_kernel)[grid](x2, packed, scales, out if pre_quant_scale is None else pre_quant_scale,
                                     out if bias is None else bias, out, x2.shape[0], N, K, x2.stride(0), group_size,
                                     HAS_PQS=pre_quant_scale is not None, HAS_BIAS=bias is not None, **meta)
    return out.view(*x.shape[:-1], N)


def pack_int4(weight: torch.Tensor, scale: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt int4 (weight [N/2, K] int8, nibbles along N; scale [N, K/g]) -> w4a16's (packed
    [N, K/2] uint8, offset-binary nibbles along K; scales [K/g, N] float32). Once, at build time."""
    n, k = weight.shape[0] * 2, weight.shape[1]
    check_group_size(group_size, k)
    if tuple(scale.shape) != (n, k // group_size):
        raise ConfigError(f"int4 weights_scaling_factor has shape {tuple(scale.shape)}; expected "
                          f"[out, in / group_size] = [{n}, {k // group_size}]")
    u = quant.unpack_int4(weight).to(torch.int16) + 8
    packed = (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), scale.float().T.contiguous()


def fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_scale: torch.Tensor,
        bias: torch.Tensor | None = None, pre_quant_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] quantized to fp8 with its static act_scale, @ weight fp8 [N, K]^T on torch._scaled_mm
    (cuBLASLt's fp8 GEMM; it runs on CPU tensors too), * scale (act_scale * weight scale, folded at
    build: 0-d, or [N] where fused parts' weight scales differ) + bias, in x's dtype.

    A 0-d scale rides _scaled_mm's own per-tensor scaling; per-row ones multiply its float32 output
    (row-wise _scaled_mm wants a bf16 output and sm90, and a float32 model has neither)."""
    if pre_quant_scale is not None:
        x = x * pre_quant_scale.to(x.dtype)
    lead, K = x.shape[:-1], x.shape[-1]
    xq = quant.quantize_fp8(x, act_scale).reshape(-1, K)
    scale = scale.float()
    one = scale.new_ones(())
    per_tensor = scale.dim() == 0
    out_dtype = x.dtype if per_tensor and bias is None else torch.float32
    y = torch._scaled_mm(xq, weight.t(), scale_a=scale if per_tensor else one, scale_b=one, out_dtype=out_dtype)
    if not per_tensor:
        y = y * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, weight.shape[0])
