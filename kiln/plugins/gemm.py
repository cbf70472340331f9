"""Build-time packing for the C++ GEMM plugin (`kiln_cpp::gemm`, csrc/gemm.cpp has the layouts).

The kernels read a [n, K] weight as panels of 16 output columns, so that one panel is one
contiguous stream and a thread's share of the panels is one contiguous range; rows past n are zero.
Within a panel, each stored row holds the k that one instruction of the native kernels consumes:
  - float32 / float16 / fp8: [panels, K, 16], one k per row;
  - bfloat16: k pairs, [panels, Kb / 2, 32] (Kb = K rounded up to 32): what `vdpbf16ps` multiplies
    and, 16 rows at a time, an AMX B tile;
  - int8: k quads, [panels, Kq / 4, 64] (Kq = K rounded up to 64): a `vpdpbusd` operand;
  - int4: k eights, [panels, K / 8, 64] bytes: one 32-bit word of nibbles per column and row;
    float16 group scales [K / g, panels * 16].
Every kernel (float, bf16, int8-activation, AMX) reads the same packed copy, so engines hold each
weight once.
"""
import torch

PANEL = 16
K_PER_ROW = {torch.bfloat16: 2, torch.int8: 4}
PAD_K = {torch.bfloat16: 32, torch.int8: 64}


def _pad(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(w, (0, cols - w.shape[1], 0, rows - w.shape[0]))


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[n, K] (float32, bf16, fp16, int8, fp8) -> the format's panels (module docstring)."""
    n, K = weight.shape
    kk, pad_k = K_PER_ROW.get(weight.dtype, 1), PAD_K.get(weight.dtype, 1)
    fp8 = weight.dtype == torch.float8_e4m3fn
    w = weight.view(torch.uint8) if fp8 else weight  # pad and permute on the bits
    w = _pad(w, _round_up(n, PANEL), _round_up(K, pad_k))
    packed = w.view(-1, PANEL, w.shape[1] // kk, kk).transpose(1, 2).reshape(-1, w.shape[1] // kk, PANEL * kk)
    packed = packed.contiguous()
    return packed.view(torch.float8_e4m3fn) if fp8 else packed


def pack_scale(scale: torch.Tensor, n: int) -> torch.Tensor:
    """A per-tensor or per-column scale -> float32 [panels * 16]."""
    s = scale.float().reshape(-1).expand(n).contiguous()
    return torch.cat([s, s.new_zeros(-n % PANEL)])


def pack_int4(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, K] ints in [-8, 7] and scale [n, K / g] -> (uint8 [panels, K / 8, 64], float16 [K / g, panels * 16]).

    Column j's eight k 8r .. 8r + 7 make bytes 4j .. 4j + 3 of row r: byte e holds k = 8r + e in its
    low nibble and k = 8r + 4 + e in its high one. The scales are float16, as llama.cpp's q4_0 block
    scales: at group 32 a float32 one would add a ninth to the bytes a batch-1 step streams."""
    n, K = q.shape
    if scale.numel() and not bool(scale.abs().amax() <= torch.finfo(torch.float16).max):
        raise ValueError(f"int4 group scales must fit float16 (|scale| <= 65504), got max {scale.abs().amax().item()}")
    u = _pad(q.to(torch.int8).view(torch.uint8) & 0xF, _round_up(n, PANEL), K)
    u = u.view(-1, PANEL, K // 8, 2, 4).permute(0, 2, 1, 3, 4)  # [panels, K / 8, 16, low/high, 4]
    packed = (u[..., 0, :] | (u[..., 1, :] << 4)).reshape(-1, K // 8, 4 * PANEL)
    scales = _pad(scale.to(torch.float16), _round_up(n, PANEL), scale.shape[1]).T
    return packed.contiguous(), scales.contiguous()


def unpack(packed: torch.Tensor, n: int, k: int | None = None) -> torch.Tensor:
    """pack's inverse (for tests and for reading a row out of a packed table)."""
    kk = K_PER_ROW.get(packed.dtype, 1)
    panels, rows = packed.shape[:2]
    w = packed.view(panels, rows, PANEL, kk).transpose(1, 2).reshape(panels * PANEL, rows * kk)
    return w[:n, : (k or rows * kk)]


def embedding(packed: torch.Tensor, ids: torch.Tensor, n: int, k: int = 0, scale: torch.Tensor | None = None,
              group_size: int = 0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows `ids` (int64, each in [0, n)) of a packed [n, k] table: a tied embedding shares the
    lm_head's packed copy. An int8 / int4 table (a quantized lm_head) comes with its scale (and
    group size) and its rows are dequantized into dtype. The C++ op (not indexing) so that a compiled
    graph gathers them once."""
    from kiln.plugins import cpp

    cpp.load()
    if packed.dtype in (torch.int8, torch.uint8):
        return torch.ops.kiln_cpp.embedding_dequant(packed, scale, ids, n, k, group_size, dtype)
    return torch.ops.kiln_cpp.embedding(packed, ids, n, k)


def gemm(x, weight, scale, bias, n: int, group_size: int = 0, out_float: bool = False, tactics=()):
    """tactics: (m_max, kernel id) pairs, flat (csrc/gemm.cpp); empty: the op's own choice."""
    from kiln.plugins import cpp

    return cpp.gemm_op()(x, weight, scale, bias, n, group_size, out_float, list(tactics))


def gemm_swiglu(x, weight, scale, bias, n: int, group_size: int = 0, tactics=()):
    """silu(y[..., :n // 2]) * y[..., n // 2:] of y = gemm(x, ...): a gated MLP's fused [gate; up]
    projection and its activation in one call (the AMX kernel fuses them in its epilogue)."""
    from kiln.plugins import cpp

    return cpp.op("gemm_swiglu")(x, weight, scale, bias, n, group_size, list(tactics))
