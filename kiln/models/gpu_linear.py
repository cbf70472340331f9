"""Linear layers on the GPU op set's GEMMs (kiln/plugins/gpu/gemm.py), built from a rank's checkpoint
tensors with kiln.models.linear.make_linear's contract: linears sharing their input fuse into one
GEMM where exact (scales concatenated along the output dim), else run as separate GEMMs whose
outputs are concatenated. Weights are laid out once, here, in the kernels' formats:

| quant_algo           | layer      | GEMM                                                                  |
|----------------------|------------|-----------------------------------------------------------------------|
| none                 | Linear     | torch.nn.functional.linear (cuBLAS: right for dense bf16)             |
| W8A16                | Int8Linear | kiln_gpu::w8a16, scale [out] float32                                  |
| W4A16(_AWQ/_GPTQ)    | Int4Linear | kiln_gpu::w4a16 (pack_int4's layout; AWQ's pre_quant_scale fused)     |
| FP8                  | FP8Linear  | torch._scaled_mm, act_scale * weight scale folded (0-d or per row)    |
| FP8_PER_CHANNEL_     | FP8Linear  | x quantized per token in the graph, torch._scaled_mm, then each row's |
|   PER_TOKEN          |            | scale times the weight's per-channel one                              |
| W8A8_SQ_PER_CHANNEL  | Int8Linear | x smoothed and rounded to its int8 grid in the graph, then w8a16 with |
|                      |            | act_scale * weight scale folded (the int8 values ride as exact bf16)  |
| W4A8_AWQ             | FP8Linear  | the fp8 weight the int4 one stands for, built once: the FP8 path      |

Scales stay float32 (the checkpoint's), so a bf16 model's quantized GEMM rounds only its output.
Zero points (W8A16, W4A16*) are added outside the kernels, quant.zero_term of the GEMM's input;
act-order's input_index is kiln.models.linear's InputGather around the layer.
"""
import torch
from torch import nn

from kiln.config import ConfigError, PretrainedConfig
from kiln.models import linear
from kiln.models.linear import (FP8_PER_TOKEN, INT4_ALGOS, SUPPORTED_QUANT_ALGOS, Linear, _fp8_weight_and_scale,
                                 _shared, _zero, quant_algo_of)
from kiln.plugins import quant
from kiln.plugins.gpu import gemm


class _Layer(nn.Module):
    def __init__(self, bias=None, pre_quant_scale=None, **tensors):
        super().__init__()
        for key, value in dict(tensors, bias=bias, pre_quant_scale=pre_quant_scale).items():
            self.register_buffer(key, value)

    def _plus_zero(self, y, x):
        """y plus the zero points' share of the GEMM on x (its input, smoothed), rounded once more."""
        return y if self.zero is None else (y + quant.zero_term(x, self.zero)).to(y.dtype)


class Int8Linear(_Layer):
    """int8 weight [out, in] * scale [out]. With act_scale (SmoothQuant W8A8) the activation is
    smoothed and rounded to its int8 grid first, and scale is act_scale * the weight's."""

    def __init__(self, weight, scale, bias=None, pre_quant_scale=None, act_scale=None, zero=None):
        super().__init__(bias, pre_quant_scale, weight=weight, scale=scale, act_scale=act_scale, zero=zero)

    def forward(self, x):
        if self.act_scale is not None:
            if self.pre_quant_scale is not None:
                x = x * self.pre_quant_scale
            x = quant.quantize_int8(x, self.act_scale).to(x.dtype)
        return self._plus_zero(torch.ops.kiln_gpu.w8a16(x, self.weight, self.scale, self.bias), x)


class Int4Linear(_Layer):
    """Group-wise int4, in gemm.pack_int4's layout (packed [out, in/2] uint8, scales [in/g, out])."""

    def __init__(self, packed, scales, group_size, bias=None, pre_quant_scale=None, zero=None):
        super().__init__(bias, pre_quant_scale, packed=packed, scales=scales, zero=zero)
        self.group_size = group_size

    def forward(self, x):
        y = torch.ops.kiln_gpu.w4a16(x, self.packed, self.scales, self.group_size, self.bias, self.pre_quant_scale)
        if self.zero is None:
            return y
        return self._plus_zero(y, x if self.pre_quant_scale is None else x * self.pre_quant_scale)


class FP8Linear(_Layer):
    """fp8 weight [out, in]; act_scale 0-d float32; scale = act_scale * weight scale (0-d or [out]).
    act_scale None: FP8_PER_CHANNEL_PER_TOKEN, x's per-token scales (quant.token_scale) times scale [out]."""

    def __init__(self, weight, scale, act_scale, bias=None, pre_quant_scale=None):
        n, k = weight.shape
        if n % 16 or k % 16:
            raise ConfigError(f"an FP8 linear of shape [{n}, {k}] is not supported; torch._scaled_mm "
                              f"expects in and out dims that are multiples of 16")
        super().__init__(bias, pre_quant_scale, weight=weight, scale=scale, act_scale=act_scale)

    def forward(self, x):
        if self.act_scale is not None:
            return gemm.fp8(x, self.weight, self.scale, self.act_scale, self.bias, self.pre_quant_scale)
        s = quant.token_scale(x)
        one = self.scale.new_ones(())  # x / s (float32) rounds to the fp8 grid as quantize_fp8(x, s) does
        y = gemm.fp8(x.float() / s, self.weight, one, one) * (s * self.scale)
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


def _build(algo, parts, dtype, group_size, bias):
    cat = lambda key: torch.cat([p[key] for p in parts])  # noqa: E731
    pqs = _shared(parts, "prequant_scaling_factor") if "prequant_scaling_factor" in parts[0] else None
    pqs = None if pqs is None else pqs.to(dtype)
    if algo is None:
        return Linear(cat("weight").to(dtype), bias)
    if algo == "W8A16":
        return Int8Linear(cat("weight"), cat("weights_scaling_factor").float(), bias, zero=_zero(parts))
    if algo in INT4_ALGOS and algo != "W4A8_AWQ":
        packed, scales = gemm.pack_int4(cat("weight"), cat("weights_scaling_factor"), group_size)
        return Int4Linear(packed, scales, group_size, bias, pqs, _zero(parts))
    if algo == FP8_PER_TOKEN:
        return FP8Linear(cat("weight"), cat("weights_scaling_factor").float(), None, bias)
    act_scale = _shared(parts, "activation_scaling_factor").reshape(()).float()
    if algo == "W8A8_SQ_PER_CHANNEL":
        scale = act_scale * cat("weights_scaling_factor").float()
        return Int8Linear(cat("weight"), scale, bias, pqs, act_scale)
    if algo == "W4A8_AWQ":
        gemm.check_group_size(group_size, parts[0]["weight"].shape[1])
    weight, scale = _fp8_weight_and_scale(algo, parts, act_scale, group_size)
    return FP8Linear(weight, scale.float(), act_scale, bias, pqs)


def make_linear(config: PretrainedConfig, weights: dict, names: list[str], bias=None) -> nn.Module:
    """One layer for the checkpoint linears `names` (full names, sharing their input), fused where exact."""
    algo = quant_algo_of(config, names[0])
    if algo is not None and algo not in SUPPORTED_QUANT_ALGOS:
        raise ConfigError(f"quantization.quant_algo {algo!r} is not supported by the GPU GEMMs; expected one of "
                          f"{', '.join(SUPPORTED_QUANT_ALGOS)}")
    return linear.make_linear(config, weights, names, bias, build=_build)
