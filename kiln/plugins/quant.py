"""Quantized GEMMs and 8-bit KV storage, in the layouts NVIDIA ModelOpt exports for TensorRT-LLM.

Each format has a reference (dequantize to float32, fake-quantize the activation with its static
scale, matmul: the spec) and two fast CPU paths: the C++ GEMM plugin (kiln/plugins/gemm.py, the
default for aoti builds: weights packed in their stored width and decoded inside the kernel), and
PyTorch kernels that eager builds and `--gemm_plugin inline` use:

| quant_algo           | weight                | activation           | ATen kernel (gemm_plugin inline)        |
|----------------------|-----------------------|----------------------|-----------------------------------------|
| W8A16                | int8, scale [out]     | model dtype          | aten._weight_int8pack_mm                |
| W4A16(_AWQ/_GPTQ)    | int4, scale [out, g]  | model dtype (* pqs)  | aten._weight_int4pack_mm_for_cpu        |
| FP8                  | fp8, scale [1] / [out]| fp8, static scale    | dense GEMM on exactly widened operands  |
| FP8_PER_CHANNEL_PER_TOKEN | fp8, scale [out] | fp8, per-token scale | the FP8 path, * each row's scale        |
| W8A8_SQ_PER_CHANNEL  | int8, scale [out]     | int8, static (* pqs) | aten._weight_int8pack_mm, int8 x as ints|
| W4A8_AWQ             | int4 -> fp8, 2 scales | fp8, static (* pqs)  | the FP8 path, on fp8 weights built once |

int4 weights arrive packed two per byte along the output dim (ModelOpt's pack_int4_in_uint8):
byte[o2, i] = q[2*o2, i] & 0xF | q[2*o2 + 1, i] << 4, q in [-8, 7], w ~ q[o, i] * scale[o, i // g].
W4A8 adds a per-tensor second scale s2 and dequantizes as fp8(q * scale / s2) * s2: ModelOpt's
fake quantization runs the int4 quantizer and then a per-tensor fp8 one over its output.

Three optional extras (pre-quantized GPTQ/AWQ/compressed-tensors checkpoints, TensorRT-LLM's names):
- zero points (quantization.has_zero_point; W8A16, W4A16*): `{name}.zero` shaped like the weight
  scale and w = q * s + zero (TensorRT-LLM's zeros_x_scales: (8 - z) * s for a uint4 zero point z).
  Kernels without a zero add it outside: x @ zero's share of w.T = group_sums(x) @ zero.T (zero_term).
- per-token FP8 (FP8_PER_CHANNEL_PER_TOKEN, vLLM's FP8_DYNAMIC): each row of x gets its own scale,
  amax(|row|) / 448 (token_scale), which multiplies the output rows.
- act-order (`{name}.input_index`, a permutation): the GEMM's input is x[..., input_index], before any
  pre-quant scale; the weight and its scales are stored in that order (kiln.models.linear.InputGather).
"""
import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


# -- element formats --------------------------------------------------------------------------

def quantize_fp8(x, scale):
    # Clamp first: a cast past 448 is not guaranteed to saturate in every backend's codegen.
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_int8(x, scale):
    return (x.float() / scale).round().clamp(-128, 127).to(torch.int8)


def quantize_to(x, scale, dtype):
    return quantize_int8(x, scale) if dtype == torch.int8 else quantize_fp8(x, scale)


def fake_quant(x, scale, dtype):
    """x quantized to int8/fp8 with a static per-tensor scale and back, in float32."""
    return quantize_to(x, scale, dtype).float() * scale


def unpack_int4(packed):
    """[out/2, in] int8 (two signed nibbles per byte along out) -> [out, in] int8 in [-8, 7]."""
    packed = packed.view(torch.int8)
    low = ((packed & 0xF) ^ 8) - 8  # sign-extend the low nibble
    high = packed >> 4  # arithmetic shift sign-extends the high one
    return torch.stack([low, high], dim=1).reshape(2 * packed.shape[0], packed.shape[1])


def pack_int4(q):
    """[out, in] int values in [-8, 7] -> ModelOpt's [out/2, in] int8 packing."""
    q = q.to(torch.int8)
    return ((q[0::2] & 0xF) | (q[1::2] << 4)).to(torch.int8)


def dequantize_int4(packed, scale, group_size, zero=None):
    w = unpack_int4(packed).float() * scale.float().repeat_interleave(group_size, dim=1)
    return w if zero is None else w + zero.float().repeat_interleave(group_size, dim=1)


def token_scale(x):
    """Per-token fp8 scales [..., 1] float32: amax(|row|) / 448; an all-zero row gets 1 (any scale
    reproduces its zeros, and a division by zero would make NaNs)."""
    amax = x.float().abs().amax(-1, keepdim=True)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def zero_term(x, zero):
    """The zero points' share of x @ w.T, float32 [..., out]: zero [out, in / g] (a per-channel one
    [out, 1]) is constant over each group of g inputs, so it multiplies the group's sum of x."""
    return x.float().unflatten(-1, (zero.shape[-1], -1)).sum(-1) @ zero.float().T


def w4a8_weight_fp8(packed, scale, scale_2, group_size):
    """The fp8 weight a W4A8 GEMM multiplies by (times scale_2)."""
    return quantize_fp8(dequantize_int4(packed, scale, group_size), scale_2.float())


# -- references: the spec ---------------------------------------------------------------------

def _ref_matmul(x, w, bias):
    y = x.float() @ w.float().T
    return y if bias is None else y + bias.float()


def _smooth(x, pre_quant_scale):
    return x if pre_quant_scale is None else x * pre_quant_scale.to(x.dtype)


def ref_w8a16(x, weight, scale, bias=None, zero=None):
    w = weight.float() * scale.float()[:, None]
    return _ref_matmul(x, w if zero is None else w + zero.float().reshape(-1, 1), bias).to(x.dtype)


def ref_w4a16(x, packed, scale, group_size, pre_quant_scale=None, bias=None, zero=None):
    w = dequantize_int4(packed, scale, group_size, zero)
    return _ref_matmul(_smooth(x, pre_quant_scale), w, bias).to(x.dtype)


def ref_fp8(x, weight, weight_scale, act_scale, bias=None):
    """weight_scale [1] (per tensor) or [out] (per channel)."""
    xq = fake_quant(x, act_scale.float(), FP8)
    return _ref_matmul(xq, weight.float() * weight_scale.float().reshape(-1, 1), bias).to(x.dtype)


def ref_fp8_per_token(x, weight, weight_scale, bias=None):
    """FP8_PER_CHANNEL_PER_TOKEN: weight_scale [out]; x quantized per row with token_scale."""
    s = token_scale(x)
    xq = quantize_fp8(x, s).float() * s
    return _ref_matmul(xq, weight.float() * weight_scale.float().reshape(-1, 1), bias).to(x.dtype)


def ref_w8a8(x, weight, weight_scale, act_scale, pre_quant_scale=None, bias=None):
    xq = fake_quant(_smooth(x, pre_quant_scale), act_scale.float(), torch.int8)
    return _ref_matmul(xq, weight.float() * weight_scale.float()[:, None], bias).to(x.dtype)


def ref_w4a8(x, packed, scale, scale_2, act_scale, group_size, pre_quant_scale=None, bias=None):
    xq = fake_quant(_smooth(x, pre_quant_scale), act_scale.float(), FP8)
    w = w4a8_weight_fp8(packed, scale, scale_2, group_size).float() * scale_2.float()
    return _ref_matmul(xq, w, bias).to(x.dtype)


# -- build-time repacking into the CPU kernels' layouts ---------------------------------------

def int4_for_cpu(packed, scale, group_size, dtype, zero=None):
    """ModelOpt int4 -> (_weight_int4pack_mm_for_cpu's weight, its scales_and_zeros in `dtype`).

    The kernel reads unsigned nibbles u and dequantizes (u - 8) * scale + zero: q = u - 8, and zero
    is the checkpoint's (0 where it has none), exactly the format's w = q * s + zero."""
    q = unpack_int4(packed).to(torch.int32) + 8
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scale = scale.float().T  # [in / g, out]
    zero = torch.zeros_like(scale) if zero is None else zero.float().T
    scales_and_zeros = torch.stack([scale, zero], dim=-1).to(dtype).contiguous()
    return weight, scales_and_zeros


# -- fast CPU paths ---------------------------------------------------------------------------

def _bias(y, bias):
    return y if bias is None else y + bias


def w8a16(x, weight, scale, bias=None):
    """weight int8 [out, in]; scale [out] in x's dtype."""
    return _bias(torch.ops.aten._weight_int8pack_mm(x, weight, scale), bias)


def w4a16(x, weight, scales_and_zeros, group_size, pre_quant_scale=None, bias=None):
    """weight/scales_and_zeros from int4_for_cpu."""
    x = _smooth(x, pre_quant_scale)
    return _bias(torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, group_size, scales_and_zeros), bias)


def fp8(x, weight, scale, act_scale, pre_quant_scale=None, bias=None):
    """weight fp8 [out, in]; act_scale float32 0-d; scale = act_scale * weight scale, folded at build.

    Both fp8 operands widen exactly to the model dtype, so this is the spec's math on a dense GEMM.
    Measured on this CPU (AVX2): torch._scaled_mm and torch._int_mm run 10-50x slower than a bf16
    GEMM of the same shape, so neither is used."""
    xq = quantize_fp8(_smooth(x, pre_quant_scale), act_scale)
    return _bias(torch.nn.functional.linear(xq.to(x.dtype), weight.to(x.dtype)) * scale, bias)


def fp8_per_token(x, weight, scale, bias=None):
    """FP8_PER_CHANNEL_PER_TOKEN: weight fp8 [out, in], scale [out] float32; x quantized per row
    (token_scale), whose scale multiplies the output row with the weight's."""
    s = token_scale(x)
    xq = quantize_fp8(x, s)
    y = torch.nn.functional.linear(xq.to(x.dtype), weight.to(x.dtype)).float() * (s * scale)
    return _bias(y, bias).to(x.dtype)


def w8a8(x, weight, scale, act_scale, pre_quant_scale=None, bias=None):
    """weight int8 [out, in]; scale [out] in x's dtype = act_scale * weight scale, folded at build.

    The int8 activation rides the int8-weight kernel as exact small integers in x's dtype."""
    xq = quantize_int8(_smooth(x, pre_quant_scale), act_scale)
    return _bias(torch.ops.aten._weight_int8pack_mm(xq.to(x.dtype), weight, scale), bias)
