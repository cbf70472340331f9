"""Writing a unified checkpoint dir: config.json, rank{N}.safetensors and the tokenizer files.

Everything is staged in a hidden dir next to the output and renamed into place at the end, so an
error or Ctrl-C part-way leaves neither a half-written checkpoint nor a damaged previous one.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

from kiln.config import PretrainedConfig, torch_dtype, write_json
from kiln.convert.hf import CheckpointError
from kiln.convert.shard import Builder
from kiln.tokenizer_files import copy_tokenizer_files


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def _is_checkpoint_dir(path: Path) -> bool:
    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and "architecture" in d and "mapping" in d


def check_output_dir(model_dir: Path, output_dir: Path) -> None:
    """Refuse outputs whose replacement would destroy something that is not an old checkpoint."""
    model, out = model_dir.resolve(), output_dir.resolve()
    if out == model or out in model.parents:
        raise CheckpointError(f"output dir {output_dir} would replace the model dir {model_dir}")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output dir {output_dir} exists and is not a directory")
    # Replacing an existing dir deletes it; only do that to an empty dir or an earlier checkpoint.
    if out.is_dir() and any(out.iterdir()) and not _is_checkpoint_dir(out):
        raise CheckpointError(
            f"output dir {output_dir} exists, is not empty and is not a checkpoint dir; refusing to "
            f"replace it (choose another --output_dir or remove it)"
        )


@contextmanager
def staged_dir(output_dir: Path) -> Iterator[Path]:
    """Yield an empty hidden dir beside output_dir; on success it becomes output_dir."""
    out = output_dir.resolve()
    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    # A uniquely named mkdir (not mkdtemp, whose 0700 mode would stick to the checkpoint).
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in created:  # innermost first: leave no empty dirs we made behind
            try:
                parent.rmdir()
            except OSError:
                break
        raise


def _swap_into_place(new: Path, out: Path) -> None:
    if not out.exists():
        new.rename(out)
        return
    # Two renames within one parent: the old checkpoint stays whole until the new one is in place.
    old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    out.rename(old)
    try:
        new.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(
    cfg: PretrainedConfig,
    weights,
    plans: list[list[tuple[str, Builder]]],
    model_dir: Path,
    output_dir: Path,
    on_tensor: Callable[[int], object] | None = None,
) -> Path:
    """Run each rank's plan against `weights` and write the checkpoint dir at output_dir.

    One rank is built and saved before the next is started, so peak memory is about one output
    shard (plus the source slice being cast).
    """
    dtype = torch_dtype(cfg.dtype)

    def build(plan):
        tensors = {}
        for name, builder in plan:
            # copy=True: safetensors may hand back views of its mmap, and two reads of one
            # tensor (tied embedding and lm_head) would then share storage, which save refuses.
            tensors[name] = builder(weights).to(dtype, copy=True).contiguous()
            if on_tensor:
                on_tensor(1)
        return tensors

    return write_ranks(cfg, (build(plan) for plan in plans), model_dir, output_dir)


def write_ranks(
    cfg: PretrainedConfig,
    ranks: Iterable[dict],
    model_dir: Path,
    output_dir: Path,
    extra_json: dict[str, dict] | None = None,
) -> Path:
    """Write each rank's tensors as they are (no casts: quantized checkpoints mix dtypes), plus
    config.json, the tokenizer files and any extra JSON files, all staged and renamed into place."""
    from safetensors.torch import save_file

    with staged_dir(output_dir) as tmp:
        write_json(tmp / "config.json", cfg.to_dict())
        # safetensors creates files 0600; give rank files the umask-derived mode config.json got.
        mode = (tmp / "config.json").stat().st_mode & 0o777
        for rank, tensors in enumerate(ranks):
            path = tmp / rank_file(rank)
            save_file(tensors, str(path), metadata={"format": "pt"})
            os.chmod(path, mode)
            del tensors
        copy_tokenizer_files(model_dir, tmp)
        for name, data in (extra_json or {}).items():
            write_json(tmp / name, data)
    return output_dir
