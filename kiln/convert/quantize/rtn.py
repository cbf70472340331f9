"""Round-to-nearest weight-only quantization (W8A16, W4A16), int4 packing and dequantization.

Scales follow ModelOpt's max calibration, so these tensors are what ModelOpt would export for the
same presets: int8 per output channel, w ~ q * s[o] with s = max|w[o, :]| / 127; int4 per group of
g inputs, w ~ q * s[o, i // g] with s = max|w[o, group]| / 7 and q in [-8, 7]. Two int4 values share
a byte along the output dimension: byte[o2, i] = (q[2*o2, i] & 0xF) | (q[2*o2 + 1, i] << 4).
"""
from __future__ import annotations

import torch

# A group of zeros would otherwise divide by zero; any scale reproduces its zeros.
_MIN_SCALE = 1e-10


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(_MIN_SCALE)
    q = (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
    return q, scale


def int4_per_group(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpacked int4 values (as int8) and their [out, in / group_size] scales."""
    w = w.float()
    out, inp = w.shape
    groups = w.reshape(out, inp // group_size, group_size)
    scale = (groups.abs().amax(dim=2) / 7.0).clamp_min(_MIN_SCALE)
    q = (groups / scale[..., None]).round().clamp(-8, 7).to(torch.int8).reshape(out, inp)
    return q, scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[out, in] int4 values in int8 -> [out / 2, in] int8 bytes, rows 2k and 2k+1 in one byte."""
    lo, hi = q[0::2], q[1::2]
    return ((lo & 0x0F) | (hi << 4)).to(torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: sign-extended int4 values, [out, in] int8."""
    lo = (packed << 4) >> 4  # arithmetic shifts on int8 sign-extend the low nibble
    hi = packed >> 4
    return torch.stack([lo, hi], dim=1).reshape(-1, packed.shape[1])


def quantize_linear(w: torch.Tensor, quant_algo: str, group_size: int) -> dict[str, torch.Tensor]:
    """A linear's checkpoint tensors (suffix -> tensor) for W8A16 or W4A16; a mixture's experts
    [experts, out, in] each on their own, stacked."""
    if w.dim() == 3:
        parts = [quantize_linear(e, quant_algo, group_size) for e in w]
        return {key: torch.stack([p[key] for p in parts]) for key in parts[0]}
    if quant_algo == "W8A16":
        q, scale = int8_per_channel(w)
        return {"weight": q, "weights_scaling_factor": scale}
    if quant_algo == "W4A16":
        q, scale = int4_per_group(w, group_size)
        return {"weight": pack_int4(q), "weights_scaling_factor": scale}
    raise ValueError(f"round-to-nearest does not make {quant_algo}")


def dequantize_linear(t: dict[str, torch.Tensor], quant_algo: str, group_size: int) -> torch.Tensor:
    """The float32 [out, in] weight a checkpoint's linear tensors stand for, with any pre-quant
    scale folded in (x @ (w * pqs).T == (x * pqs) @ w.T), zero points added (w = q * s + zero) and
    act-order's input_index undone: columns in the input's own order (x[..., idx] @ w.T == x @ w'.T
    with w'[:, idx] = w)."""
    weight, scale = t["weight"], t["weights_scaling_factor"].float()
    if weight.dim() == 3:  # a mixture's experts: per-expert tensors stack, per-tensor ones are shared
        return torch.stack([dequantize_linear({k: v[e] if v.dim() > 1 else v for k, v in t.items()}, quant_algo,
                                              group_size) for e in range(weight.shape[0])])
    zero = t["zero"].float() if "zero" in t else None
    if quant_algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):  # scale [1] or per channel [out]
        w = weight.float() * scale.reshape(-1, 1)
    elif quant_algo in ("W8A16", "W8A8_SQ_PER_CHANNEL"):
        w = weight.float() * scale[:, None] + (0 if zero is None else zero.reshape(-1, 1))
    elif quant_algo in ("W4A16", "W4A16_AWQ", "W4A16_GPTQ", "W4A8_AWQ"):
        w = unpack_int4(weight).float() * scale.repeat_interleave(group_size, dim=1)
        if zero is not None:
            w = w + zero.repeat_interleave(group_size, dim=1)
    else:
        raise ValueError(f"cannot dequantize {quant_algo}")
    if "prequant_scaling_factor" in t:
        w = w * t["prequant_scaling_factor"].float()[None, :]
    if "input_index" in t:
        w = torch.empty_like(w).index_copy_(1, t["input_index"].long(), w)
    return w
