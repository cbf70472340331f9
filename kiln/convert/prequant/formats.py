"""Which pre-quantized format a HF checkpoint is, from its `quantization_config`, and its reader.

Every reader checks the config fields it is given against what it can read and refuses the rest in
one line naming the field (a 3-bit GPTQ, NVFP4, a Marlin-repacked checkpoint), before any tensor is
read. `read(weights, prefix)` turns HF linear `prefix` (e.g. model.layers.0.self_attn.q_proj) into a
plain form of kiln.convert.prequant.linears, or returns None where the linear is stored unquantized.
"""
from __future__ import annotations

from typing import Any

from kiln.config import ConfigError

# config.json's quant_method of the formats Kiln reads (vLLM's --quantization names them so too)
METHODS = ("gptq", "awq", "compressed-tensors", "modelopt", "bitsandbytes")


class Reader:
    method: str  # quant_method, as config.json names it
    exact: bool = True  # False: dequantized to float (no Kiln kernel runs the format exactly)
    symmetric: bool = True  # every zero point is the codes' midpoint
    group_size: int = 0  # inputs per scale; 0: one per output channel
    bits: int = 0  # 4 or 8 for integer formats; 0 for fp8 and float ones
    dynamic_activations: bool = False  # FP8 with per-token activation scales
    skip: tuple[str, ...] = ()  # HF module names (or re: patterns) left unquantized by the format

    def describe(self) -> str:
        raise NotImplementedError

    def read(self, weights, prefix: str):
        raise NotImplementedError


def _field(qc: dict, key: str, expected: tuple, method: str, default: Any = None):
    value = qc.get(key, default)
    if value not in expected:
        raise ConfigError(f"{method} checkpoint with {key}={value!r} is not supported; expected one of "
                          f"{', '.join(map(repr, expected))}")
    return value


def detect(hf: dict) -> Reader | None:
    """The reader for HF config `hf`'s quantization_config (None: an unquantized checkpoint)."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"quantization_config must be a JSON object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "gptq":
        from kiln.convert.prequant.gptq import GPTQReader
        return GPTQReader(qc)
    if method == "awq":
        from kiln.convert.prequant.gptq import AWQReader
        return AWQReader(qc)
    if method == "compressed-tensors":
        from kiln.convert.prequant.compressed import CompressedTensorsReader
        return CompressedTensorsReader(qc)
    if method == "modelopt":
        from kiln.convert.prequant.fp8 import ModelOptReader
        return ModelOptReader(qc)
    if method == "bitsandbytes":
        from kiln.convert.prequant.bnb import BitsAndBytesReader
        return BitsAndBytesReader(qc)
    raise ConfigError(f"pre-quantized checkpoints with quant_method {method!r} are not supported; expected one of "
                      f"{', '.join(METHODS)}")
