"""A model as vLLM and TensorRT-LLM's LLM API take it: an engine dir as it is, or a Hugging Face
model dir converted and built on first use, as `trtllm-serve MODEL` and TensorRT-LLM's `LLM(model)`
build one. The engine is cached under $KILN_CACHE_DIR/engines, keyed by the model's files and the
options the build depends on, so the second start loads it without building; a build is written to a
temporary dir and renamed into place, under a lock that a second process building the same key waits
on."""
from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kiln.config import ConfigError
from kiln.plugins.cpp import cache_root

# A model dir's files that decide the engine built from it.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class BuildRequest:
    """What an engine built from a Hugging Face dir depends on (vLLM's options, resolved)."""
    dtype: str | None  # None: the checkpoint's
    tp_size: int = 1
    pp_size: int = 1
    qformat: str | None = None
    max_batch_size: int = 256
    max_seq_len: int = 2048  # prompt + output: the model's derived positions, or what was asked beyond them
    max_num_tokens: int = 2048
    backend: str = "aoti"
    lora_config: dict | None = None
    eagle_model_dir: str | None = None  # an EAGLE-3 draft converted beside the model (kiln/convert/eagle3.py)


def is_engine_dir(path) -> bool:
    try:
        return "build_config" in json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def is_hf_dir(path) -> bool:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False
    return isinstance(config, dict) and ("architectures" in config or "model_type" in config)


def check_model(model) -> None:
    """ConfigError unless `model` is a directory (what kind of one, the loaders say)."""
    if not Path(model).expanduser().is_dir():
        raise ConfigError(f"model {model}: no such directory (Kiln loads local dirs: an engine dir written by "
                          f"engine-build, or a Hugging Face model dir with config.json and safetensors weights)")


def engine_for(model, request: BuildRequest, log=print) -> Path:
    """The engine dir for `model`: itself if it is one, else the cached build of the HF dir."""
    path = Path(model).expanduser()
    if is_engine_dir(path):
        return path
    check_model(model)
    if not is_hf_dir(path):
        raise ConfigError(f"model {model}: neither an engine dir (config.json with build_config) nor a Hugging "
                          f"Face model dir (config.json with architectures)")
    key = _key(path, request)
    out = cache_root() / "engines" / f"{path.resolve().name}-{key}"
    if is_engine_dir(out):
        log(f"model {model}: the engine built for it before, {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same engine: wait for it
        if not is_engine_dir(out):
            _build(path, out, request, log)
    return out


def _key(model: Path, request: BuildRequest) -> str:
    from kiln.version import __version__

    h = hashlib.sha256(json.dumps([str(model.resolve()), asdict(request), __version__]).encode())
    files = sorted(model.iterdir()) + (sorted(Path(request.eagle_model_dir).iterdir()) if request.eagle_model_dir else [])
    for f in files:
        if f.name in MODEL_FILES:
            h.update(f.name.encode() + f.read_bytes())
        elif f.suffix == ".safetensors":  # weights by name, size and time: a changed file builds anew
            stat = f.stat()
            h.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _build(model: Path, out: Path, request: BuildRequest, log) -> None:
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig
    from kiln.convert.cli import convert_checkpoint
    from kiln.convert.quantize.pipeline import QuantOptions

    start = time.monotonic()
    log(f"model {model}: converting and building an engine on first use ({request.backend}, tp {request.tp_size}, "
        f"{request.dtype or 'the checkpoint dtype'}{', ' + request.qformat if request.qformat else ''}); "
        f"cached in {out}")
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        quant = QuantOptions(request.qformat, default_calibration=True) if request.qformat else None
        ckpt = convert_checkpoint(model, work / "checkpoint", request.dtype, request.tp_size, request.pp_size,
                                  quant=quant, log=log, eagle_model_dir=request.eagle_model_dir)
        seq_len = request.max_seq_len  # a prompt may take all of it, as in vLLM
        build = BuildConfig(max_batch_size=request.max_batch_size, max_seq_len=seq_len, max_input_len=seq_len,
                            max_num_tokens=max(request.max_num_tokens, request.max_batch_size),
                            backend=request.backend, lora_config=request.lora_config)
        build_engine(ckpt, work / "engine", build, log=lambda line: line.startswith("warning") and log(line),
                     workers=min(request.tp_size * request.pp_size, 2))
        (work / "engine").rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"model {model}: engine built in {time.monotonic() - start:.0f}s -> {out}")

