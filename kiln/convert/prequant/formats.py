"""Which pre-quantized format a HF checkpoint is, from its `quantization_config`, and its reader.

Every reader checks the config fields it is given against what it can read and refuses the rest in
one line naming the field (a 3-bit GPTQ, NVFP4, a Marlin-repacked checkpoint), before any tensor is
read. `read(weights, prefix)` turns HF linear `prefix` (e.g. model.layers.0.self_attn.q_proj) into a
plain form of kiln.convert.prequant.linears, or returns None where the linear is stored unquantized.
"""
from __future__ import annotations

from kiln.config import ConfigError
from kiln.convert.prequant.reader import Reader

# config.json's quant_method of the formats Kiln reads (vLLM's --quantization names them so too)
METHODS = ("gptq", "awq", "compressed-tensors", "modelopt", "bitsandbytes")


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
