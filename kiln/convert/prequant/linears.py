"""The plain forms a pre-quantized HF linear is read into, whatever its format packed it as."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntLinear:
    """w[o, i] = (codes[o, i] - zero[o, group[i]]) * scale[o, group[i]], codes unsigned in [0, 2**bits)."""
    codes: torch.Tensor  # int32 [out, in]
    scale: torch.Tensor  # float32 [out, groups]
    zero: torch.Tensor  # float32 [out, groups], in the codes' unsigned domain (2**(bits-1): symmetric)
    group: torch.Tensor  # int64 [in]: each input's group (GPTQ's g_idx)
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        return (self.codes.float() - self.zero[:, self.group]) * self.scale[:, self.group]


@dataclass
class FP8Linear:
    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [1] or [out]
    input_scale: torch.Tensor | None  # float32 [1]; None: activations quantized per token at run time

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        scale = self.scale.float()
        return self.weight.float() * (scale[:, None] if scale.numel() > 1 else scale)


@dataclass
class FloatLinear:
    """A format no Kiln kernel runs exactly, dequantized by its reader (bitsandbytes' NF4/FP4)."""
    weight: torch.Tensor  # float32 [out, in]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        return self.weight


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 words holding 32 / bits codes each, low bits first, along `dim` -> the codes (int32,
    unsigned) with that dim 32 / bits times longer. `order`: the position in its word's run of codes of
    the code in each field (AWQ's GEMM layout interleaves them)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = packed.to(torch.int32).movedim(dim, -1)
    fields = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per]
    if order is not None:
        fields = fields[..., torch.argsort(torch.tensor(order))]
    return fields.reshape(*moved.shape[:-1], moved.shape[-1] * per).movedim(-1, dim)
