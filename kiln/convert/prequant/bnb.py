"""bitsandbytes 4-bit checkpoints (transformers' BitsAndBytesConfig(load_in_4bit=True), saved).

Per linear: `weight` uint8 (two 4-bit codes per byte, the first in the high nibble, the weight
flattened row-major), `weight.absmax` (one scale per `blocksize` values), `weight.quant_map` (the 16
code values: NF4's or FP4's), and `weight.quant_state.bitsandbytes__nf4|fp4` (JSON bytes: shape,
blocksize, and for double quantization nested_blocksize and nested_offset). With double quantization
the absmax are 8-bit codes themselves: nested_quant_map[code] * nested_absmax[block] + nested_offset.
No Kiln kernel runs NF4/FP4, so the weights are dequantized (in float32, exactly as bitsandbytes' own
dequantize_4bit computes them) and the converter writes them in the checkpoint's dtype, or quantizes
them again where --qformat asks.
"""
from __future__ import annotations

import json

import torch

from kiln.config import ConfigError
from kiln.convert.hf import CheckpointError
from kiln.convert.prequant.reader import Reader
from kiln.convert.prequant.linears import FloatLinear


class BitsAndBytesReader(Reader):
    method = "bitsandbytes"
    exact = False

    def __init__(self, qc: dict):
        if qc.get("load_in_8bit"):
            raise ConfigError("bitsandbytes checkpoint with load_in_8bit=true (LLM.int8) is not supported; expected "
                              "load_in_4bit (NF4/FP4)")
        if not qc.get("load_in_4bit"):
            raise ConfigError("bitsandbytes checkpoint without load_in_4bit is not supported; expected NF4/FP4 weights")
        self.quant_type = qc.get("bnb_4bit_quant_type", "fp4")
        if self.quant_type not in ("nf4", "fp4"):
            raise ConfigError(f"bitsandbytes checkpoint with bnb_4bit_quant_type={self.quant_type!r} is not supported; "
                              f"expected 'nf4' or 'fp4'")
        self.double = bool(qc.get("bnb_4bit_use_double_quant"))

    def describe(self) -> str:
        return f"bitsandbytes {self.quant_type.upper()}{' (double quantization)' if self.double else ''}"

    def read(self, weights, prefix: str) -> FloatLinear | None:
        state_name = next((f"{prefix}.weight.quant_state.bitsandbytes__{t}" for t in ("nf4", "fp4")
                           if f"{prefix}.weight.quant_state.bitsandbytes__{t}" in weights), None)
        if state_name is None:
            return None
        state = json.loads(bytes(weights.read(state_name).tolist()).decode())
        shape, block = tuple(state["shape"]), state["blocksize"]
        packed = weights.read(f"{prefix}.weight").reshape(-1).to(torch.uint8)
        n = shape[0] * shape[1]
        if packed.numel() * 2 < n:
            raise CheckpointError(f"tensor {prefix}.weight holds {packed.numel() * 2} 4-bit codes, expected {n}")
        codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()
        absmax = weights.read(f"{prefix}.weight.absmax")
        if "nested_blocksize" in state:
            nested = weights.read(f"{prefix}.weight.nested_absmax").float()
            table = weights.read(f"{prefix}.weight.nested_quant_map").float()
            index = torch.arange(absmax.numel()) // state["nested_blocksize"]
            absmax = table[absmax.long()] * nested[index] + state["nested_offset"]
        absmax = absmax.float()
        if absmax.numel() != -(-n // block):
            raise CheckpointError(f"tensor {prefix}.weight.absmax has {absmax.numel()} blocks, expected "
                                  f"{-(-n // block)} of {block} for shape {list(shape)}")
        values = weights.read(f"{prefix}.weight.quant_map").float()[codes]
        values = values * absmax.repeat_interleave(block)[:n]
        return FloatLinear(values.reshape(shape))
