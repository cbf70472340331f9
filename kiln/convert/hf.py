"""Reading a local Hugging Face model dir's safetensors weights (its config.json: hf_config.py).

Weights are read lazily, one tensor (or one rank's slice of a tensor) at a time, so converting
never holds the whole model in memory. Pickle formats (`pytorch_model.bin`, `.pt`) are refused
outright: unpickling runs arbitrary code.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kiln.config import ConfigError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


class CheckpointError(ConfigError):
    """A weights file that cannot be used: missing, corrupt, or not matching its config."""


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


# Where a multimodal checkpoint (config.json with a text_config) keeps its text model's
# `model.*` and `lm_head.*` tensors: transformers 5 and transformers 4.
TEXT_MODEL_PREFIXES = (("model.language_model.", "lm_head."), ("language_model.model.", "language_model.lm_head."))


class HFWeights:
    """Lazy access to the tensors of a HF model dir by their causal-LM names; use as a context manager.

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
        self._stored: dict[str, str] = {}  # causal-LM name -> the name in the file, where they differ
        self._parts: dict[str, tuple[str, int, int]] = {}  # part of a fused tensor -> (fused name, first row, rows)
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
            self._alias_text_model()
        except BaseException:
            self._stack.close()
            raise

    def _alias_text_model(self) -> None:
        if "model.embed_tokens.weight" in self._handles:
            return
        for model, head in TEXT_MODEL_PREFIXES:
            if model + "embed_tokens.weight" in self._handles:
                for stored in list(self._handles):
                    for prefix, canonical in ((model, "model."), (head, "lm_head.")):
                        if stored.startswith(prefix):
                            name = canonical + stored[len(prefix):]
                            self._stored[name] = stored
                            self._handles[name], self._file_of[name] = self._handles[stored], self._file_of[stored]
                return

    def unfuse(self, fused: dict[str, list[tuple[str, int]]]) -> None:
        """Read fused tensors (Phi-3's qkv_proj, gate_up_proj) by the names of their parts: fused name ->
        [(part name, rows)], the parts stacked along dim 0 in that order."""
        for name, parts in fused.items():
            if name not in self._handles:
                continue  # check() names whatever is missing
            offset = 0
            for part, rows in parts:
                self._parts[part] = (name, offset, rows)
                offset += rows
            total = self.shape(name)[0]
            if total != offset:
                raise CheckpointError(f"tensor {name!r} in {self._file_of[name]} has {total} rows, expected {offset} "
                                      f"({' + '.join(str(r) for _, r in parts)}) from config.json")

    def __enter__(self) -> "HFWeights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self._handles or name in self._parts

    def _where(self, name: str) -> str:
        if name in self._index:
            return f"{self.model_dir / self._index[name]} (per {SAFETENSORS_INDEX})"
        if len(self.files) == 1:
            return str(self.files[0])
        return str(self.model_dir)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._parts:
            fused, _, rows = self._parts[name]
            return (rows, *self.shape(fused)[1:])
        if name not in self._handles:
            raise CheckpointError(f"tensor {name!r} not found in {self._where(name)}")
        return tuple(self._handles[name].get_slice(self._stored.get(name, name)).get_shape())

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Raise on the first tensor that is missing or whose shape differs from its config's."""
        for name, shape in expected.items():
            got = self.shape(name)
            if got != tuple(shape):
                where = self._file_of[self._parts[name][0] if name in self._parts else name]
                raise CheckpointError(
                    f"tensor {name!r} in {where} has shape {list(got)}, expected "
                    f"{list(shape)} from config.json"
                )

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None):
        """Read `name`, or only rows/columns [start, stop) along `dim`, without loading the rest."""
        if name in self._parts:
            fused, first, rows = self._parts[name]
            if dim == 0:
                start, stop, _ = slice(start, stop).indices(rows)
                return self.read(fused, 0, first + start, first + stop)
            whole = self.read(fused, 0, first, first + rows)
            start, stop, _ = slice(start, stop).indices(whole.shape[dim])
            return whole.narrow(dim, start, stop - start)
        if name not in self._handles:
            raise CheckpointError(f"tensor {name!r} not found in {self._where(name)}")
        stored = self._stored.get(name, name)
        try:
            if start is None and stop is None:  # whole (and a 0-d scale cannot be sliced)
                return self._handles[name].get_tensor(stored)
            return self._handles[name].get_slice(stored)[(slice(None),) * dim + (slice(start, stop),)]
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {self._file_of[name]}: {e}") from None
