"""One rank's weights from its checkpoint file, checked against the tensors its model expects."""
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.config import ConfigError, PretrainedConfig, torch_dtype
from kiln.models.linear import FP8
from kiln.models.llama import checkpoint_tensors


def load_rank_weights(checkpoint_dir: Path, config: PretrainedConfig, rank: int) -> dict:
    path = checkpoint_dir / f"rank{rank}.safetensors"
    if not path.is_file():
        raise ConfigError(f"{path} not found: the checkpoint's mapping (world_size "
                          f"{config.mapping.world_size}) needs one file per rank")
    expected = checkpoint_tensors(config, rank, optional=True)
    dtype = torch_dtype(config.dtype)
    weights = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            missing = sorted(n for n, spec in expected.items()
                             if n not in names and not getattr(spec, "optional", False))
            if missing:
                raise ConfigError(f"{path}: missing tensor {missing[0]}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
            for name, spec in expected.items():
                if name not in names:
                    continue  # optional (missing ones were refused above)
                (shape, kind), t = spec, f.get_tensor(name)
                if tuple(t.shape) not in getattr(spec, "shapes", (shape,)):
                    expected_shape = " or ".join(map(str, getattr(spec, "shapes", (shape,))))
                    raise ConfigError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {expected_shape}"
                                      + _quantized_note(config, name))
                weights[name] = _as_kind(t, kind, dtype, f"{path}: tensor {name}", _quantized_note(config, name))
    except ConfigError:
        raise
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ConfigError(f"{path} is not a readable safetensors file: {e}") from None
    return weights


def _quantized_note(config: PretrainedConfig, name: str) -> str:
    q = config.quantization
    if q.quant_algo and (".attention." in name or ".mlp." in name) and "layernorm" not in name:
        return f" (quant_algo {q.quant_algo})"
    if q.kv_cache_quant_algo and name.endswith("kv_cache_scaling_factor"):
        return f" (kv_cache_quant_algo {q.kv_cache_quant_algo})"
    return ""


def _as_kind(t: torch.Tensor, kind, dtype: torch.dtype, what: str, note: str) -> torch.Tensor:
    """Checks a checkpoint tensor's dtype and casts only what is meant to be cast: quantized tensors
    keep their bits, scales stay float32."""
    floating = t.is_floating_point() and t.dtype != FP8
    if kind in ("model", "scale"):
        if not floating:
            raise ConfigError(f"{what} has dtype {t.dtype}, expected a float dtype{note}")
        return t.to(dtype if kind == "model" else torch.float32)
    if kind == "int4":
        if t.dtype not in (torch.int8, torch.uint8):
            raise ConfigError(f"{what} has dtype {t.dtype}, expected int8 holding two int4 values per byte{note}")
        return t.view(torch.int8)
    if t.dtype != kind:
        raise ConfigError(f"{what} has dtype {t.dtype}, expected {kind}{note}")
    return t
