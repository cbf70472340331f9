"""compressed-tensors checkpoints (llm-compressor's output; vLLM's "compressed-tensors").

quantization_config: `format` ("pack-quantized": int weights; "float-quantized": FP8), `config_groups`
(each a scheme: `weights` {num_bits, type int|float, strategy tensor|channel|group, group_size,
symmetric, actorder}, `input_activations` {dynamic, strategy} or null, `targets`), `ignore` (modules
left unquantized). pack-quantized: `weight_packed` int32 [out, in * bits / 32] (codes packed along the
input, low bits first, stored as q + 2**(bits-1)), `weight_scale` [out, groups], `weight_shape`,
asymmetric `weight_zero_point` (packed the same way along the output dim), act-order `weight_g_idx`.
float-quantized: `weight` float8_e4m3fn, `weight_scale` [1] or [out, 1], static `input_scale` [1].
"""
from __future__ import annotations

import torch

from kiln.config import ConfigError
from kiln.convert.hf import CheckpointError
from kiln.convert.prequant.reader import Reader
from kiln.convert.prequant.linears import FP8Linear, IntLinear, unpack_int32
from kiln.plugins.quant import FP8

WHAT = "compressed-tensors checkpoint"


class CompressedTensorsReader(Reader):
    method = "compressed-tensors"

    def __init__(self, qc: dict):
        if qc.get("kv_cache_scheme"):
            raise ConfigError(f"{WHAT} with a kv_cache_scheme is not supported yet; expected null")
        if qc.get("sparsity_config"):
            raise ConfigError(f"{WHAT} with a sparsity_config (sparse weights) is not supported; expected {{}}")
        schemes = list((qc.get("config_groups") or {}).values())
        if not schemes:
            raise ConfigError(f"{WHAT} without config_groups is not supported; expected one quantization scheme")
        if any(s != schemes[0] for s in schemes[1:]):
            raise ConfigError(f"{WHAT} with {len(schemes)} different config_groups is not supported; expected one "
                              f"scheme for every quantized linear")
        scheme = schemes[0]
        self.format = scheme.get("format") or qc.get("format")
        weights, act = scheme.get("weights") or {}, scheme.get("input_activations")
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        if self.format == "float-quantized" and kind == "float" and bits == 8 and strategy in ("tensor", "channel"):
            if act is None or act.get("type") != "float" or act.get("num_bits") != 8:
                raise ConfigError(f"{WHAT}: FP8 weights with input_activations={act!r} are not supported; expected "
                                  f"FP8 activations (static per tensor, or dynamic per token)")
            self.dynamic_activations = bool(act.get("dynamic"))
            if act.get("strategy") not in (("token",) if self.dynamic_activations else ("tensor",)):
                raise ConfigError(f"{WHAT}: FP8 activations with strategy {act.get('strategy')!r} (dynamic "
                                  f"{self.dynamic_activations}) are not supported; expected static per tensor or "
                                  f"dynamic per token")
            self.kind = "fp8"
        elif self.format == "pack-quantized" and kind == "int" and bits in (4, 8) and strategy in ("channel", "group"):
            if act is not None:
                raise ConfigError(f"{WHAT}: int{bits} weights with quantized input_activations are not supported; "
                                  f"expected weight-only (W4A16, W8A16)")
            self.kind, self.bits = "int", bits
            self.group_size = weights.get("group_size") or 0 if strategy == "group" else 0
            self.symmetric = weights.get("symmetric", True)
        else:
            fp4 = " (Kiln has no FP4 kernel)" if self.format and "fp4" in self.format else ""
            raise ConfigError(f"{WHAT} with format {self.format!r}, {bits}-bit {kind} weights per {strategy}{fp4} is not "
                              f"supported; expected pack-quantized int4/int8 (per channel or group) or "
                              f"float-quantized FP8 (per tensor or channel)")

    def describe(self) -> str:
        if self.kind == "fp8":
            return (f"compressed-tensors FP8 ({'dynamic per-token' if self.dynamic_activations else 'static'} "
                    f"activations)")
        group = f"group {self.group_size}" if self.group_size else "per channel"
        return f"compressed-tensors W{self.bits}A16, {group}, {'symmetric' if self.symmetric else 'zero points'}"

    def read(self, weights, prefix: str):
        if self.kind == "fp8":
            if f"{prefix}.weight_scale" not in weights:
                return None
            weight = weights.read(f"{prefix}.weight")
            if weight.dtype != FP8:
                raise CheckpointError(f"tensor {prefix}.weight is {weight.dtype}, expected float8_e4m3fn")
            scale = weights.read(f"{prefix}.weight_scale").float().reshape(-1)
            inp = None if self.dynamic_activations else weights.read(f"{prefix}.input_scale").float().reshape(1)
            return FP8Linear(weight, scale, inp)
        if f"{prefix}.weight_packed" not in weights:
            return None
        out, inp = weights.read(f"{prefix}.weight_shape").tolist()
        codes = unpack_int32(weights.read(f"{prefix}.weight_packed"), self.bits, 1)
        if codes.shape[0] != out or codes.shape[1] < inp:
            raise CheckpointError(f"tensor {prefix}.weight_packed holds [{codes.shape[0]}, {codes.shape[1]}] codes, "
                                  f"expected [{out}, {inp}] (its weight_shape)")
        scale = weights.read(f"{prefix}.weight_scale").float()
        groups = -(-inp // self.group_size) if self.group_size else 1
        if tuple(scale.shape) != (out, groups):
            raise CheckpointError(f"tensor {prefix}.weight_scale has shape {list(scale.shape)}, expected {[out, groups]}")
        if self.symmetric:
            zero = torch.full_like(scale, 1 << (self.bits - 1))
        else:
            zero = unpack_int32(weights.read(f"{prefix}.weight_zero_point"), self.bits, 0)[:out].float()
        group = (weights.read(f"{prefix}.weight_g_idx").long() if f"{prefix}.weight_g_idx" in weights
                 else torch.arange(inp) // (self.group_size or inp))
        return IntLinear(codes[:, :inp].contiguous(), scale, zero, group, self.bits)
