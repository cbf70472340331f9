"""Reading a local Hugging Face model dir: its config.json and its safetensors weights.

Weights are read lazily, one tensor (or one rank's slice of a tensor) at a time, so converting
never holds the whole model in memory. Pickle formats (`pytorch_model.bin`, `.pt`) are refused
outright: unpickling runs arbitrary code.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kiln.config import (
    DTYPES,
    SUPPORTED_ARCHITECTURES,
    ConfigError,
    Mapping,
    PretrainedConfig,
)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


class CheckpointError(ConfigError):
    """A weights file that cannot be used: missing, corrupt, or not matching its config."""


# ---------------------------------------------------------------------------------------------
# config.json


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"model dir {model_dir} not found (expected a Hugging Face model directory)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found (expected a Hugging Face config.json)")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return hf


def _rotary_scaling(hf: dict, where: Path) -> dict | None:
    scaling = hf.get("rope_scaling")
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    # Newer transformers write "rope_type", older ones "type" (and LlamaConfig writes both);
    # TensorRT-LLM's rotary_scaling uses "type".
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    out["type"] = kind
    return out


def _check_sliding_window(hf: dict, where: Path) -> None:
    # Qwen2/Qwen3 configs carry a sliding_window that is inactive unless use_sliding_window is set;
    # Mistral has no such switch, so there a window is in effect whenever one is given.
    if hf.get("use_sliding_window") is False:
        return
    window = hf.get("sliding_window")
    max_pos = hf.get("max_position_embeddings")
    if window is None or max_pos is None or window >= max_pos:
        return
    raise ConfigError(
        f"{where}: sliding_window {window} is smaller than max_position_embeddings {max_pos}; "
        f"sliding-window attention is not supported (expected sliding_window null or >= "
        f"max_position_embeddings)"
    )


def _default_dtype(hf: dict, where: Path) -> str:
    # transformers >= 4.56 writes "dtype"; older versions "torch_dtype".
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ConfigError(
            f"{where}: torch_dtype {name!r} is not supported; pass --dtype with one of {', '.join(DTYPES)}"
        )
    return name


def pretrained_config_from_hf(
    hf: dict[str, Any],
    dtype: str | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    where: Path | str = "config.json",
) -> PretrainedConfig:
    """Map a Hugging Face config.json dict onto Kiln's (TensorRT-LLM's) checkpoint config."""
    where = Path(where)
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else hf.get("model_type", "<none>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{where}: architecture {arch!r} is not supported; expected one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise ConfigError(
            f"{where}: pre-quantized HF checkpoints ({method}) are not supported; convert the "
            f"unquantized model"
        )
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size", "max_position_embeddings")
    missing = [k for k in required if hf.get(k) is None]
    if missing:
        raise ConfigError(f"{where} is missing field(s): {', '.join(missing)}")
    # Qwen2 always has q/k/v biases (and none on o_proj), which is what attn_bias means here.
    # Elsewhere attention_bias/mlp_bias also put biases on o_proj or the MLP, which we do not model.
    attn_bias = arch == "Qwen2ForCausalLM"
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key) and not (arch == "Qwen2ForCausalLM" and key == "attention_bias"):
            raise ConfigError(f"{where}: {key}=true is not supported for {arch}")
    _check_sliding_window(hf, where)

    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    return PretrainedConfig(
        architecture=arch,
        dtype=dtype or _default_dtype(hf, where),
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        # Qwen3 (and some Mistral) decouple head_dim from hidden_size / heads.
        head_size=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf["max_position_embeddings"],
        hidden_act=hf.get("hidden_act", "silu"),
        norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        rotary_base=float(hf.get("rope_theta", 10000.0)),
        rotary_scaling=_rotary_scaling(hf, where),
        attn_bias=attn_bias,
        qk_layernorm=arch == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        mapping=Mapping(world_size=tp_size * pp_size, tp_size=tp_size, pp_size=pp_size),
    )


# ---------------------------------------------------------------------------------------------
# safetensors weights


def safetensors_files(model_dir: Path) -> tuple[list[Path], dict[str, str]]:
    """The weight files of a model dir, and the index's name -> file map (empty when unsharded)."""
    index_path = model_dir / SAFETENSORS_INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path} is not a valid safetensors index ({e})") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{model_dir}: shard file(s) {', '.join(missing)} listed in {SAFETENSORS_INDEX} not found"
            )
        return [model_dir / n for n in names], dict(weight_map)
    single = model_dir / SAFETENSORS_FILE
    if single.is_file():
        return [single], {}
    pickles = sorted({p.name for pat in PICKLE_PATTERNS for p in model_dir.glob(pat)})
    if pickles:
        raise CheckpointError(
            f"{model_dir} has only pickle weights ({', '.join(pickles)}); Kiln never loads pickles - "
            f"re-save the model with save_pretrained(..., safe_serialization=True)"
        )
    raise CheckpointError(
        f"{model_dir}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} found (expected safetensors weights)"
    )


class HFWeights:
    """Lazy access to the tensors of a HF model dir; use as a context manager.

    Every file is opened (its header parsed and checked against the file size) up front, so a
    truncated file is reported before anything is written.
    """

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.model_dir = Path(model_dir)
        self.files, self._index = safetensors_files(self.model_dir)
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}  # tensor name -> open file
        self._file_of: dict[str, Path] = {}
        try:
            for path in self.files:
                try:
                    handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
                except Exception as e:  # safetensors raises its own SafetensorError (an Exception)
                    raise CheckpointError(
                        f"{path} is not a readable safetensors file (truncated or corrupt?): "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                    ) from None
                for name in handle.keys():
                    self._handles[name] = handle
                    self._file_of[name] = path
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> "HFWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def _where(self, name: str) -> str:
        if name in self._index:
            return f"{self.model_dir / self._index[name]} (per {SAFETENSORS_INDEX})"
        if len(self.files) == 1:
            return str(self.files[0])
        return str(self.model_dir)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._handles:
            raise CheckpointError(f"tensor {name!r} not found in {self._where(name)}")
        return tuple(self._handles[name].get_slice(name).get_shape())

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Raise on the first tensor that is missing or whose shape differs from its config's."""
        for name, shape in expected.items():
            got = self.shape(name)
            if got != tuple(shape):
                raise CheckpointError(
                    f"tensor {name!r} in {self._file_of[name]} has shape {list(got)}, expected "
                    f"{list(shape)} from config.json"
                )

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None):
        """Read `name`, or only rows/columns [start, stop) along `dim`, without loading the rest."""
        if name not in self._handles:
            raise CheckpointError(f"tensor {name!r} not found in {self._where(name)}")
        piece = self._handles[name].get_slice(name)
        index = (slice(None),) * dim + (slice(start, stop),)
        try:
            return piece[index]
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {self._file_of[name]}: {e}") from None
