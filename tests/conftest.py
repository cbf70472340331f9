"""Session-wide tiny models and engines, built once and shared by every test that asks."""
import importlib
import json
import os
import sys
from pathlib import Path

# The Triton kernels (kiln/plugins/gpu) run on CPU tensors in Triton's interpreter, which triton
# reads when a kernel is decorated: set before anything imports them, here and in every subprocess.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_model  # noqa: E402

# `make test` sets it: there a missing optional dependency is a failure, never a silent skip.
STRICT = os.environ.get("KILN_TEST_STRICT") == "1"
MODELOPT = ("modelopt.torch.quantization", "NVIDIA ModelOpt is not installed (pip install 'kiln-llm[quant]')")


def require(module: str, what: str, module_level: bool = False) -> None:
    """Skip the test (or the module) when `module` cannot be imported, saying what is missing and
    how to get it; under KILN_TEST_STRICT=1, fail instead."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        message = f"{what}: {type(e).__name__}: {e}"
        if STRICT:
            pytest.fail(message, pytrace=False)
        pytest.skip(message, allow_module_level=module_level)


TEST_BUILD = dict(max_batch_size=8, max_input_len=128, max_seq_len=192, max_num_tokens=256,
                  tokens_per_block=8)


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 2))  # OMP_NUM_THREADS=1: a slow run


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """hf_model(name) -> HF model dir of the tiny variant `name` (tests/tiny_models.py)."""
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = make_model(name, tmp_path_factory.mktemp(f"hf_{name}"))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def checkpoint(hf_model, tmp_path_factory):
    from kiln.convert.cli import convert_checkpoint

    cache = {}

    def get(name: str, dtype: str = "float32") -> Path:
        key = (name, dtype)
        if key not in cache:
            cache[key] = convert_checkpoint(hf_model(name), tmp_path_factory.mktemp(f"ckpt_{name}") / "c",
                                            dtype=dtype)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def engine(checkpoint, tmp_path_factory):
    """engine(name, backend="eager", dtype="float32", **build_overrides) -> engine dir, built once per key."""
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig

    cache = {}

    def get(name: str, backend: str = "eager", dtype: str = "float32", **overrides) -> Path:
        key = (name, backend, dtype, json.dumps(overrides, sort_keys=True))  # values may be dicts
        if key not in cache:
            build = BuildConfig(**{**TEST_BUILD, **overrides, "backend": backend})
            out = tmp_path_factory.mktemp(f"engine_{name}_{backend}") / "e"
            cache[key] = build_engine(checkpoint(name, dtype), out, build, log=lambda *_: None)
        return cache[key]

    return get
