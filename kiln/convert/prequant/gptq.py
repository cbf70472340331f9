"""GPTQ (AutoGPTQ / GPTQModel / transformers' GPTQConfig) and AWQ (AutoAWQ) checkpoints.

GPTQ, checkpoint_format "gptq" (v1) or "gptq_v2": per linear `qweight` int32 [in * bits / 32, out]
(codes packed along the input, low bits first), `qzeros` int32 [groups, out * bits / 32], `scales`
[groups, out], `g_idx` int32 [in] (each input's group; act-order, desc_act, permutes it). v1 stores
each zero point minus one, and its kernels add the one back (a zero point of 0 reads as 2**bits).
AWQ GEMM: `qweight` int32 [in, out / 8] and `qzeros` [groups, out / 8], packed along the output with
the eight codes of a word interleaved (fields hold outputs 0, 2, 4, 6, 1, 3, 5, 7), `scales` [groups,
out]. AWQ GEMV: `qweight` [out, in / 8] packed along the input in order, `qzeros` [out, words] along
the groups and `scales` [out, 8 * words], both padded past the real groups.
"""
from __future__ import annotations

import torch

from kiln.config import ConfigError
from kiln.convert.hf import CheckpointError
from kiln.convert.prequant.reader import Reader, checked_field
from kiln.convert.prequant.linears import IntLinear, unpack_int32

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} for its "
                              f"linear's packing")


def _groups(group_size: int, inp: int) -> torch.Tensor:
    return torch.arange(inp) // (group_size if group_size > 0 else inp)


class GPTQReader(Reader):
    method = "gptq"

    def __init__(self, qc: dict):
        self.bits = checked_field(qc, "bits", (4, 8), "GPTQ")
        self.group_size = qc.get("group_size", 128)
        if not isinstance(self.group_size, int) or self.group_size == 0 or self.group_size < -1:
            raise ConfigError(f"GPTQ checkpoint with group_size={self.group_size!r} is not supported; expected a "
                              f"positive group size or -1 (per channel)")
        self.group_size = max(self.group_size, 0)
        self.desc_act = bool(qc.get("desc_act", False))
        self.symmetric = bool(qc.get("sym", True))
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        self.v1 = checked_field({"checkpoint_format": fmt}, "checkpoint_format", ("gptq", "gptq_v2"), "GPTQ") == "gptq"
        if qc.get("lm_head"):
            raise ConfigError("GPTQ checkpoint with a quantized lm_head (lm_head=true) is not supported; Kiln's "
                              "lm_head is unquantized or quantized at build (engine-build --quantize_lm_head)")
        if qc.get("dynamic"):
            raise ConfigError("GPTQ checkpoint with per-module overrides (dynamic) is not supported; expected one "
                              "bits/group_size for every linear")

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per channel"
        return (f"GPTQ {self.bits}-bit, {group}, {'symmetric' if self.symmetric else 'zero points'}"
                f"{', act-order' if self.desc_act else ''} ({'v1' if self.v1 else 'v2'} format)")

    def read(self, weights, prefix: str) -> IntLinear | None:
        if f"{prefix}.qweight" not in weights:
            return None
        qweight, qzeros, scales = (weights.read(f"{prefix}.{k}") for k in ("qweight", "qzeros", "scales"))
        per = 32 // self.bits
        inp, out = qweight.shape[0] * per, qweight.shape[1]
        groups = -(-inp // self.group_size) if self.group_size else 1
        _check_shape(f"{prefix}.scales", scales, (groups, out))
        _check_shape(f"{prefix}.qzeros", qzeros, (groups, out // per))
        codes = unpack_int32(qweight, self.bits, 0).T
        # v1 stores each zero point minus one; the one comes back per code, as its kernels (and vLLM's) add
        # it. A zero point of 0 does not survive v1's packing in any producer (it borrows from, or ORs
        # into, its neighbours), so no reading of one is right.
        zero = unpack_int32(qzeros, self.bits, 1).float() + (1 if self.v1 else 0)
        if f"{prefix}.g_idx" in weights:
            group = weights.read(f"{prefix}.g_idx").long()
            _check_shape(f"{prefix}.g_idx", group, (inp,))
            if group.min() < 0 or group.max() >= groups:
                raise CheckpointError(f"tensor {prefix}.g_idx holds groups outside 0..{groups - 1}")
        else:
            group = _groups(self.group_size, inp)
        return IntLinear(codes.contiguous(), scales.float().T.contiguous(), zero.T.contiguous(), group, self.bits)


class AWQReader(Reader):
    method = "awq"

    def __init__(self, qc: dict):
        self.bits = checked_field(qc, "bits", (4,), "AWQ", qc.get("w_bit", 4))
        self.group_size = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ConfigError(f"AWQ checkpoint with group_size={self.group_size!r} is not supported; expected a "
                              f"positive group size")
        version = str(qc.get("version", "gemm")).lower()
        self.version = checked_field({"version": version}, "version", ("gemm", "gemv"), "AWQ")
        self.symmetric = not qc.get("zero_point", True)

    def describe(self) -> str:
        return (f"AWQ 4-bit, group {self.group_size}, {'symmetric' if self.symmetric else 'zero points'} "
                f"({self.version.upper()} packing)")

    def read(self, weights, prefix: str) -> IntLinear | None:
        if f"{prefix}.qweight" not in weights:
            return None
        qweight, qzeros, scales = (weights.read(f"{prefix}.{k}") for k in ("qweight", "qzeros", "scales"))
        if self.version == "gemm":
            inp, out = qweight.shape[0], qweight.shape[1] * 8
            groups = inp // self.group_size
            _check_shape(f"{prefix}.scales", scales, (groups, out))
            _check_shape(f"{prefix}.qzeros", qzeros, (groups, out // 8))
            codes = unpack_int32(qweight, 4, 1, AWQ_ORDER).T
            zero = unpack_int32(qzeros, 4, 1, AWQ_ORDER).T.float()
            scale = scales.float().T
        else:
            out, inp = qweight.shape[0], qweight.shape[1] * 8
            groups = inp // self.group_size
            words = qzeros.shape[1]  # AutoAWQ pads the groups (calculate_zeros_width); the padding is zeros
            if words * 8 < groups:
                raise CheckpointError(f"tensor {prefix}.qzeros has shape {list(qzeros.shape)}, expected [{out}, >= "
                                      f"{-(-groups // 8)}] for {groups} groups")
            _check_shape(f"{prefix}.qzeros", qzeros, (out, words))
            _check_shape(f"{prefix}.scales", scales, (out, words * 8))
            codes = unpack_int32(qweight, 4, 1)
            zero = unpack_int32(qzeros, 4, 1)[:, :groups].float()
            scale = scales.float()[:, :groups]
        return IntLinear(codes.contiguous(), scale.contiguous(), zero.contiguous(),
                         _groups(self.group_size, inp), self.bits)
