"""What every pre-quantized format's reader answers (kiln/convert/prequant/formats.py picks one)."""
from __future__ import annotations

from typing import Any

from kiln.config import ConfigError


class Reader:
    """A format's reader: what the converter asks of it. A linear the format left unquantized (its ignore
    list, modules_to_not_convert) is one whose quantized tensors are absent: read() returns None."""
    method: str  # quant_method, as config.json names it
    exact: bool = True  # False: dequantized to float (no Kiln kernel runs the format exactly)
    symmetric: bool = True  # every zero point is the codes' midpoint
    group_size: int = 0  # inputs per scale; 0: one per output channel
    bits: int = 0  # 4 or 8 for integer formats; 0 for fp8 and float ones
    dynamic_activations: bool = False  # FP8 with per-token activation scales

    def describe(self) -> str:
        raise NotImplementedError

    def read(self, weights, prefix: str):
        raise NotImplementedError


def checked_field(qc: dict, key: str, expected: tuple, method: str, default: Any = None):
    value = qc.get(key, default)
    if value not in expected:
        raise ConfigError(f"{method} checkpoint with {key}={value!r} is not supported; expected one of "
                          f"{', '.join(map(repr, expected))}")
    return value
