"""Pre-quantized HF checkpoints (GPTQ, AWQ, compressed-tensors, ModelOpt's HF export, bitsandbytes),
converted into Kiln's quantized checkpoint without re-quantizing.

A format's reader (`formats.py` picks it from config.json's `quantization_config`) turns each HF linear's
tensors into one of three plain forms (`linears.py`): integer codes with group scales and zero points,
fp8 weights with their scales, or a float weight where no Kiln kernel runs the format exactly
(bitsandbytes' NF4/FP4). `mapping.py` lays those out as Kiln's W4A16/W8A16/FP8 tensors, and
`convert.py` writes the checkpoint.
"""
from kiln.convert.prequant.formats import Reader, detect, METHODS

__all__ = ["Reader", "detect", "METHODS"]
