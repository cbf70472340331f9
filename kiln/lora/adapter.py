"""LoRA adapters as read and checked: per target module and layer, A [r, in] and B [out, r] with
alpha / r (rsLoRA: alpha / sqrt(r)) folded into B, in TensorRT-LLM's module names (kiln/models/lora.py).

Read from a Hugging Face PEFT dir (adapter_config.json + adapter_model.safetensors), where anything
PEFT does that changes the math and Kiln does not implement is refused in one line (DoRA,
modules_to_save, biases, per-module rank or alpha patterns, ...); or from TensorRT-LLM's C++ runtime
format (model.lora_weights.npy: a row per module and layer, A then B flattened; model.lora_config.npy:
[module id, layer, rank] per row), which `kiln lora convert` writes and Triton requests carry.
shard.py splits an adapter over an engine's ranks."""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.config import ConfigError, Mapping, PretrainedConfig
from kiln.models.lora import HF_MODULES, MODULE_IDS, module_shapes

_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# PEFT keys that must be at their neutral value: what they would change, Kiln does not compute.
_NEUTRAL = {"use_dora": False, "modules_to_save": None, "bias": "none", "rank_pattern": {}, "alpha_pattern": {},
            "layers_to_transform": None, "layers_pattern": None, "fan_in_fan_out": False, "megatron_config": None,
            "layer_replication": None, "lora_bias": False, "trainable_token_indices": None}


@dataclass
class Adapter:
    """One PEFT adapter, read and checked: its rank, scale and every layer's A and B per Kiln module."""
    path: Path
    rank: int
    scale: float
    modules: list[str]  # TensorRT-LLM's names
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B)


def read_adapter(adapter_dir, config: PretrainedConfig) -> Adapter:
    """config: the base model's (the TensorRT-LLM format's rows are split into A and B by its sizes)."""
    path = Path(adapter_dir)
    config_file = path / "adapter_config.json"
    if not config_file.is_file() and (path / TRTLLM_WEIGHTS).is_file():
        import numpy as np

        return from_trtllm(path, np.load(path / TRTLLM_WEIGHTS), np.load(path / TRTLLM_CONFIG), config)
    if not config_file.is_file():
        raise ConfigError(f"{config_file} not found (expected a PEFT LoRA adapter dir, or {TRTLLM_WEIGHTS} and "
                          f"{TRTLLM_CONFIG})")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file} is not valid JSON: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{config_file}: peft_type {cfg.get('peft_type')!r} is not supported; expected 'LORA'")
    for key, neutral in _NEUTRAL.items():
        value = cfg.get(key, neutral)
        if value != neutral and not (value in (None, [], {}) and neutral in (None, {})):
            raise ConfigError(f"{config_file}: {key}={value!r} is not supported (expected {neutral!r}); "
                              f"merge the adapter into the model instead")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"{config_file}: r {rank!r} is not supported; expected an integer >= 1")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ConfigError(f"{config_file}: lora_alpha {alpha!r} is not supported; expected a number")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    weights = _read_weights(path)
    pairs = {}
    for key, t in weights.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in HF_MODULES:
            raise ConfigError(f"{path}: adapter tensor {key} is not supported; expected lora_A/lora_B of "
                              f"{', '.join(HF_MODULES)} in a decoder layer")
        pairs.setdefault((int(m.group(1)), HF_MODULES[m.group(2)]), {})[m.group(3)] = t
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != rank or ab["B"].shape[1] != rank:
            raise ConfigError(f"{path}: layer {layer} {module}: expected lora_A [r={rank}, in] and lora_B "
                              f"[out, r={rank}], got {({k: tuple(v.shape) for k, v in ab.items()})}")
    if not pairs:
        raise ConfigError(f"{path}: the adapter has no LoRA tensors")
    return Adapter(path, rank, scale, sorted({m for _, m in pairs}),
                   {k: (ab["A"].float(), ab["B"].float() * scale) for k, ab in pairs.items()})


TRTLLM_WEIGHTS, TRTLLM_CONFIG = "model.lora_weights.npy", "model.lora_config.npy"
_MODULE_NAMES = {i: m for m, i in MODULE_IDS.items()}


def from_trtllm(source, weights, rows, config: PretrainedConfig) -> Adapter:
    """An adapter in TensorRT-LLM's C++ runtime format (B already scaled): `weights` [1?, rows, width],
    `rows` [1?, rows, 3 or 4] of (module id, layer, rank[, is_dora]), numpy arrays as loaded or as a
    Triton request's lora_weights / lora_config carry them; `source` names them in errors."""
    import numpy as np

    weights, rows = np.asarray(weights), np.asarray(rows)
    weights = weights.reshape(weights.shape[-2:]) if weights.ndim == 3 and len(weights) == 1 else weights
    rows = rows.reshape(rows.shape[-2:]) if rows.ndim == 3 and len(rows) == 1 else rows
    if weights.ndim != 2 or rows.ndim != 2 or rows.shape[1] not in (3, 4) or len(rows) != len(weights):
        raise ConfigError(f"{source}: LoRA weights {list(weights.shape)} and config {list(rows.shape)} are not "
                          f"TensorRT-LLM's [rows, width] and [rows, 3] with a config row per weights row")
    if not np.issubdtype(rows.dtype, np.integer) or not np.issubdtype(weights.dtype, np.floating):
        raise ConfigError(f"{source}: LoRA config must be integers and weights floats, got {rows.dtype} and "
                          f"{weights.dtype}")
    shapes = module_shapes(dataclasses.replace(config, mapping=Mapping()))
    pairs = {}
    for i, (row, (module_id, layer, rank, *dora)) in enumerate(zip(weights, rows.tolist())):
        module = _MODULE_NAMES.get(module_id)
        where = f"{source}: LoRA config row {i} ({module or f'module {module_id}'}, layer {layer}, rank {rank})"
        if module is None:
            raise ConfigError(f"{where}: module id {module_id} is not supported; expected one of "
                              f"{', '.join(f'{i} ({m})' for m, i in MODULE_IDS.items())}")
        if dora and dora[0]:
            raise ConfigError(f"{where}: DoRA rows are not supported")
        if not 0 <= layer < config.num_hidden_layers:
            raise ConfigError(f"{where}: the model has layers 0..{config.num_hidden_layers - 1}")
        size_in, size_out = shapes[module]
        if rank < 1 or rank * (size_in + size_out) > len(row):
            raise ConfigError(f"{where}: needs rank * {size_in + size_out} = {rank * (size_in + size_out)} "
                              f"weights (A [{rank}, {size_in}] then B [{size_out}, {rank}]); its row has {len(row)}")
        if (layer, module) in pairs:
            raise ConfigError(f"{where}: a second row for the same module and layer")
        flat = torch.from_numpy(np.ascontiguousarray(row[:rank * (size_in + size_out)])).float()
        pairs[layer, module] = (flat[:rank * size_in].view(rank, size_in), flat[rank * size_in:].view(size_out, rank))
    if not pairs:
        raise ConfigError(f"{source}: the adapter has no LoRA rows")
    return Adapter(Path(str(source)), max(a.shape[0] for a, _ in pairs.values()), 1.0, sorted({m for _, m in pairs}),
                   pairs)


def to_trtllm(adapter: Adapter, dtype: str = "float16"):
    """The adapter in TensorRT-LLM's C++ runtime format: (weights [1, rows, width], config [1, rows, 3])."""
    import numpy as np

    items = sorted(adapter.weights.items(), key=lambda kv: (kv[0][0], MODULE_IDS[kv[0][1]]))
    flat = [torch.cat([a.flatten(), b.flatten()]).numpy() for _, (a, b) in items]
    weights = np.zeros((1, len(flat), max(len(f) for f in flat)), dtype=dtype)
    for i, f in enumerate(flat):
        weights[0, i, :len(f)] = f
    rows = np.array([[[MODULE_IDS[m], layer, a.shape[0]] for (layer, m), (a, _) in items]], dtype=np.int32)
    return weights, rows


def save_trtllm(path: Path, weights, rows) -> None:
    """Weights and config in TensorRT-LLM's file names, which read_adapter reads back."""
    import numpy as np

    np.save(path / TRTLLM_WEIGHTS, weights)
    np.save(path / TRTLLM_CONFIG, rows)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    file = path / "adapter_model.safetensors"
    if file.is_file():
        with safe_open(file, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    if (path / "adapter_model.bin").is_file():
        return torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise ConfigError(f"{path}: no adapter_model.safetensors (or adapter_model.bin)")


def check_adapter(adapter: Adapter, config: PretrainedConfig, lora_config: dict) -> None:
    """That the engine can run the adapter: its rank, modules and layers."""
    allowed = lora_config["lora_target_modules"]
    if adapter.rank > lora_config["max_lora_rank"]:
        raise ConfigError(f"{adapter.path}: rank {adapter.rank} exceeds the engine's max_lora_rank "
                          f"{lora_config['max_lora_rank']}")
    extra = [m for m in adapter.modules if m not in allowed]
    if extra:
        raise ConfigError(f"{adapter.path}: adapts {', '.join(extra)}, which the engine was not built for "
                          f"(--lora_target_modules {' '.join(allowed)})")
    shapes = module_shapes(dataclasses.replace(config, mapping=Mapping()))
    for (layer, module), (a, b) in adapter.weights.items():
        if layer >= config.num_hidden_layers or (a.shape[1], b.shape[0]) != shapes[module]:
            raise ConfigError(f"{adapter.path}: layer {layer} {module} is [{a.shape[1]} -> {b.shape[0]}]; the "
                              f"model's is {'absent' if layer >= config.num_hidden_layers else shapes[module]} "
                              f"(an adapter of another model?)")
