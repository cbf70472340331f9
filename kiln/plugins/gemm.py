"""Build-time packing for the C++ GEMM plugin (`kiln_cpp::gemm`, csrc/gemm.cpp).

The kernel reads a [n, K] weight as panels of 16 output columns, [panels, K, 16], so that one
panel is one contiguous stream and each k of it is 16 adjacent values; rows past n are zero.
int4 goes two k per byte (low nibble first, two's complement), with its group scales as
[K / g, panels * 16].
"""
import torch

PANEL = 16


def _pad_rows(w: torch.Tensor) -> torch.Tensor:
    pad = -w.shape[0] % PANEL
    return w if pad == 0 else torch.cat([w, w.new_zeros(pad, *w.shape[1:])])


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[n, K] (any dtype the kernel takes: float, bf16, fp16, int8, fp8) -> [panels, K, 16]."""
    w = _pad_rows(weight)
    return w.view(-1, PANEL, w.shape[1]).transpose(1, 2).contiguous()


def pack_scale(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A per-tensor or per-column scale -> float32 [panels * 16]."""
    return _pad_rows(scale.float().reshape(-1).expand(n).contiguous())


def pack_int4(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, K] ints in [-8, 7] and scale [n, K / g] -> (uint8 [panels, K / 2, 16], float32 [K / g, panels * 16])."""
    u = pack(q.to(torch.int8).view(torch.uint8) & 0xF)  # [panels, K, 16]
    packed = u[:, 0::2] | (u[:, 1::2] << 4)
    return packed.contiguous(), _pad_rows(scale.float()).T.contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack's inverse (for tests and for reading a row out of a packed table)."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


def embedding(packed: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Rows `ids` (int64, each in [0, n)) of a packed [n, K] table: a tied embedding shares the
    lm_head's packed copy. The C++ op (not indexing) so that a compiled graph gathers them once."""
    from kiln.plugins import cpp

    cpp.load()
    return torch.ops.kiln_cpp.embedding(packed, ids, n)


def gemm(x, weight, scale, bias, n: int, group_size: int = 0, out_float: bool = False):
    from kiln.plugins import cpp

    return cpp.gemm_op()(x, weight, scale, bias, n, group_size, out_float)
