"""The plain forms of a Kiln linear's HF parts laid out as Kiln's quantized checkpoint tensors.

int4 codes become W4A16 (stored q = code - 8, packed two output rows per byte), 8-bit per-channel codes
W8A16 (q = code - 128), with `zero` = (midpoint - zero point) * scale where the format has zero
points, so that w = q * s + zero (TensorRT-LLM's `zero`). Groups are re-cut to a size Kiln's int4
kernels take (one that divides the format's; a per-channel scale repeats), which is exact. An
act-order linear's inputs are sorted by group once, here: its columns in that order, and
`input_index` saying which input each one reads.
"""
from __future__ import annotations

import torch

from kiln.config import ConfigError
from kiln.convert.hf import CheckpointError
from kiln.convert.prequant.linears import FloatLinear, FP8Linear, IntLinear
from kiln.plugins.quant import pack_int4


def sort_by_group(lin: IntLinear) -> tuple[IntLinear, torch.Tensor | None]:
    """The linear with its inputs in group order, and the order (None where they already are)."""
    if bool((lin.group[1:] >= lin.group[:-1]).all()):
        return lin, None
    order = torch.argsort(lin.group, stable=True)
    return IntLinear(lin.codes[:, order], lin.scale, lin.zero, lin.group[order], lin.bits), order


def permute_rows(lin, rows: torch.Tensor):
    """The linear with its outputs in order `rows` (an act-order down_proj's order, moved onto the
    rows of the gate_proj/up_proj that feed it)."""
    if isinstance(lin, IntLinear):
        return IntLinear(lin.codes[rows], lin.scale[rows], lin.zero[rows], lin.group, lin.bits)
    if isinstance(lin, FP8Linear):
        return FP8Linear(lin.weight[rows], lin.scale[rows] if lin.scale.numel() > 1 else lin.scale, lin.input_scale)
    return FloatLinear(lin.weight[rows])


def _kiln_groups(lin: IntLinear, group_size: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per Kiln group of `group_size` consecutive inputs."""
    inp = lin.codes.shape[1]
    first = lin.group[::group_size]
    if inp % group_size or not bool((lin.group.view(-1, group_size) == first[:, None]).all()):
        raise CheckpointError(f"{name}: its quantization groups are not runs of {group_size} inputs; expected "
                              f"every group's inputs together (after sorting by g_idx)")
    return lin.scale[:, first], lin.zero[:, first]


def int_tensors(lin: IntLinear, group_size: int, zero_point: bool, name: str) -> dict[str, torch.Tensor]:
    mid = 1 << (lin.bits - 1)
    if lin.bits == 4:
        scale, zero = _kiln_groups(lin, group_size, name)
    else:
        if lin.scale.shape[1] != 1:
            raise ConfigError(f"{name}: 8-bit group-wise weights have no Kiln kernel; expected per-channel scales")
        scale, zero = lin.scale, lin.zero
    if not zero_point and not bool((zero == mid).all()):
        raise CheckpointError(f"{name}: the checkpoint is symmetric, but its zero points are not all {mid}")
    q = (lin.codes - mid).to(torch.int8)
    out = {"weight": pack_int4(q) if lin.bits == 4 else q,
           "weights_scaling_factor": scale if lin.bits == 4 else scale[:, 0]}
    if zero_point:
        term = (mid - zero) * scale
        out["zero"] = term if lin.bits == 4 else term[:, 0]
    return {k: v.contiguous() for k, v in out.items()}


def fp8_tensors(parts: list[FP8Linear], dynamic: bool) -> dict[str, torch.Tensor]:
    weight = torch.cat([p.weight for p in parts])
    scales = [p.scale.float().reshape(-1) for p in parts]
    if all(s.numel() == 1 for s in scales) and all(torch.equal(s, scales[0]) for s in scales):
        scale = scales[0]
    else:  # per-tensor scales that differ between fused parts become per-row ones, exactly
        scale = torch.cat([s.expand(p.weight.shape[0]) for s, p in zip(scales, parts)])
    out = {"weight": weight, "weights_scaling_factor": scale.contiguous()}
    if not dynamic:
        # One activation scale per fused GEMM: the largest of its parts' (as vLLM and ModelOpt's export fuse them)
        out["activation_scaling_factor"] = torch.stack([p.input_scale.float().reshape(()) for p in parts]).amax()[None]
    return out


def kiln_tensors(parts: list, group_size: int, zero_point: bool, dynamic: bool, name: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of Kiln linear `name` from its HF parts' plain forms (all one kind)."""
    if isinstance(parts[0], FP8Linear):
        return fp8_tensors(parts, dynamic)
    if isinstance(parts[0], FloatLinear):
        return {"weight": torch.cat([p.weight for p in parts])}
    sorted_parts = [sort_by_group(p) for p in parts]
    orders = [o for _, o in sorted_parts]
    if any((o is None) != (orders[0] is None) or (o is not None and not torch.equal(o, orders[0])) for o in orders):
        raise CheckpointError(f"{name}: its parts (fused in one GEMM) have different act-order input orders (g_idx)")
    each = [int_tensors(p, group_size, zero_point, name) for p, _ in sorted_parts]
    out = {k: torch.cat([e[k] for e in each]) for k in each[0]}
    if orders[0] is not None:
        out["input_index"] = orders[0].to(torch.int32)
    return out


def kiln_group_size(reader_group: int, inputs: list[int], what: str) -> int:
    """The largest int4 group size Kiln's kernels take that divides the format's group (any, per channel)
    and every linear input a rank holds."""
    from kiln.models.linear import INT4_GROUP_SIZES

    fits = [g for g in INT4_GROUP_SIZES if (not reader_group or reader_group % g == 0) and all(i % g == 0 for i in inputs)]
    if not fits:
        raise ConfigError(f"{what}: no int4 group size Kiln's kernels take ({', '.join(map(str, INT4_GROUP_SIZES))}) "
                          f"divides its group size {reader_group or 'per channel'} and every linear input a rank "
                          f"holds ({', '.join(map(str, sorted(set(inputs))))})")
    return max(fits)
