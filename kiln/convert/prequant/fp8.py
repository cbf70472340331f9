"""ModelOpt's unified HF export (`export_hf_checkpoint`): config.json's quantization_config has
quant_method "modelopt" and ModelOpt's quant_algo. FP8: per linear `weight` float8_e4m3fn [out, in],
`weight_scale` and `input_scale` float32 scalars (static per-tensor scales, as TensorRT-LLM's FP8)."""
from __future__ import annotations

from kiln.config import ConfigError
from kiln.convert.prequant.reader import Reader
from kiln.convert.prequant.linears import FP8Linear
from kiln.plugins.quant import FP8


class ModelOptReader(Reader):
    method = "modelopt"

    def __init__(self, qc: dict):
        algo = qc.get("quant_algo")
        if algo != "FP8":
            no_kernel = " (Kiln has no FP4 kernel)" if algo and "FP4" in str(algo) else ""
            raise ConfigError(f"ModelOpt checkpoint with quant_algo={algo!r}{no_kernel} is not supported; expected "
                              f"'FP8' (or convert the unquantized model with convert_checkpoint --qformat)")
        if qc.get("kv_cache_quant_algo"):
            raise ConfigError(f"ModelOpt checkpoint with kv_cache_quant_algo={qc['kv_cache_quant_algo']!r} is not "
                              f"supported yet; expected null (Kiln's FP8 KV cache is made by convert_checkpoint "
                              f"--kv_cache_dtype fp8 from the unquantized model)")

    def describe(self) -> str:
        return "ModelOpt FP8 (per-tensor weight and activation scales)"

    def read(self, weights, prefix: str) -> FP8Linear | None:
        if f"{prefix}.weight_scale" not in weights:
            return None
        weight = weights.read(f"{prefix}.weight")
        if weight.dtype != FP8:
            raise ConfigError(f"tensor {prefix}.weight is {weight.dtype}, expected float8_e4m3fn beside its weight_scale")
        return FP8Linear(weight, weights.read(f"{prefix}.weight_scale").float().reshape(1),
                         weights.read(f"{prefix}.input_scale").float().reshape(1))
