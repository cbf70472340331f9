"""The C++ plugins (namespace `kiln_cpp`): built from kiln/plugins/csrc on first use, then cached.

`torch.ops.kiln_cpp.paged_attention` is a `TORCH_LIBRARY` op (CPU kernel + Meta kernel) in a shared
library built with `torch.utils.cpp_extension`. Being C++, an AOTInductor package that calls it runs
wherever that library is loaded, with or without Python (DESIGN.md, constraint 4): loaded global,
since the package calls the ops through their C shims (kiln/plugins/c_shims.py). The same library
holds the GEMM (`kiln_cpp::gemm`) and the runtime's token sampler (`kiln_cpp::sample`, used by
kiln/runtime/core/sample/sampler.py).

Importing this module is cheap; `load()` (or `ensure_built()`) builds the library once per source
and torch version and loads it. The build cache lives under $KILN_CACHE_DIR (default ~/.cache/kiln)
in a folder keyed by a hash of the sources, the flags and the torch build, so a changed source or a
new torch gets a fresh build and an old one is never loaded against the wrong libtorch. Build ahead
of time (e.g. in `make install`) with `python -m kiln.plugins.cpp`, which prints the library's path.

One library runs on any x86-64 CPU: the kernel is compiled once per ATen CPU capability (DEFAULT,
AVX2, AVX512: target options per file, as ATen builds its own kernels) and the op picks at run time
the one ATen picks for its own ops (`ATEN_CPU_CAPABILITY` overrides both). So the cached library
may be shared between machines (an NFS home, a container image) and copied next to an engine for a
C++ runner; `-march=native` would tie it to the building CPU and fail with SIGILL elsewhere.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

NAME = "kiln_cpp"
CSRC = Path(__file__).parent / "csrc"
# Registration first: on ELF the linker keeps the first copy of an inline function it meets, so
# code shared with the AVX2/AVX-512 files comes from a file built without those target options.
SOURCES = ("paged_attention.cpp", "gemm.cpp", "thread_pool.cpp", "cpu_features.cpp", "kernels_default.cpp",
           "kernels_avx2.cpp", "paged_attention_avx512.cpp", "gemm_avx512.cpp", "gemm_amx.cpp", "attention_bf16.cpp",
           "sampler.cpp", "all_reduce.cpp", "elementwise.cpp", "embedding.cpp", "moe.cpp", "lora.cpp", "lora_bf16.cpp",
           "cpu_allocator.cpp", "attention.cpp", "c_shim.cpp")
HEADERS = ("gemm_op.h", "paged_attention.h", "paged_attention_kernel.h", "paged_attention_x86.h", "gemm.h",
           "gemm_kernel.h",
           "gemm_avx512.h", "sampler.h", "sampler_kernel.h", "vec_common.h", "thread_pool.h",
           "elementwise.h", "elementwise_kernel.h", "lora.h", "lora_kernel.h", "amx_tiles.h", "op_dtype.h",
           "paged_attention_op.h", "c_shim.h")
# -fopenmp: at::parallel_for is a header template that only runs in parallel when compiled with
# OpenMP; libgomp resolves to the copy libtorch already loaded (same soname), so one thread pool.
CFLAGS = ["-O3", "-fopenmp", "-DNDEBUG", "-Wall", "-Wno-unused-parameter"]
# --as-needed drops the libtorch_python that cpp_extension links by default: the library must load
# in a process without Python. The rpath finds libtorch when a C++ runner dlopens the library.
LDFLAGS = ["-Wl,--as-needed", "-fopenmp"]

_loaded: str | None = None


class PluginBuildError(ImportError):
    """The C++ plugins cannot be built or loaded here (no compiler, no ninja, a compile error).

    An ImportError: a broken installation, not a broken engine file."""


def cache_root() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")


def _key() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes() + b"\0")
    torch_build = f"{torch.__version__} {getattr(torch.version, 'git_version', '')} {torch.version.cuda}"
    h.update(" ".join(CFLAGS + LDFLAGS + [torch_build, sys.platform, platform.machine()]).encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """Where this version of the library is built: keyed by the sources, flags and torch build."""
    return cache_root() / "torch_extensions" / f"{NAME}-torch{torch.__version__.split('+')[0]}-{_key()}"


def library_path() -> Path:
    return build_dir() / f"{NAME}.so"


def is_loaded() -> bool:
    """Whether the kiln_cpp ops are registered in this process (by load() or by whoever loaded the
    library: a second load of the same namespace would fail)."""
    return hasattr(torch.ops, NAME) and hasattr(getattr(torch.ops, NAME), "paged_attention")


def _check_toolchain() -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise PluginBuildError(
            f"the C++ plugins (gpt_attention_plugin='cpp') are compiled once on first use, but the C++ "
            f"compiler {cxx!r} is not on PATH; install one (e.g. `apt-get install g++`) or set CXX, or "
            f"build engines without the C++ plugin")
    try:
        from torch.utils.cpp_extension import verify_ninja_availability
        verify_ninja_availability()
    except RuntimeError:
        raise PluginBuildError(
            "the C++ plugins are built with ninja, which is not installed; `pip install ninja`") from None


def _build(directory: Path) -> Path:
    from torch.utils import cpp_extension

    _check_toolchain()
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"  # cpp_extension's; a build killed midway leaves it, and others would wait forever
    if lock.exists() and time.time() - lock.stat().st_mtime > 900:
        lock.unlink(missing_ok=True)
    print(f"kiln: building the C++ plugins (once; about a minute) in {directory}", file=sys.stderr, flush=True)
    start = time.time()
    ldflags = LDFLAGS + [f"-Wl,-rpath,{cpp_extension.TORCH_LIB_PATH}"]
    try:
        # cpp_extension locks the folder while one process builds; others wait, then load.
        path = cpp_extension.load(name=NAME, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=CFLAGS,
                                  extra_ldflags=ldflags, build_directory=str(directory),
                                  is_python_module=False, verbose=False)
    except Exception as e:
        detail = str(e).strip().splitlines()
        raise PluginBuildError(
            f"building the C++ plugins in {directory} failed ({type(e).__name__}: "
            f"{detail[0] if detail else ''}); see {directory / 'build.ninja'} and rerun "
            f"`python -m kiln.plugins.cpp` for the compiler's output") from e
    (directory / "complete").write_text(f"{path}\n")
    print(f"kiln: built the C++ plugins in {time.time() - start:.0f}s -> {path}", file=sys.stderr, flush=True)
    return Path(path)


def load() -> str:
    """Builds (once) and loads the library; returns its path. Idempotent and cheap once loaded."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if is_loaded():  # registered by someone else (an embedding process, another copy of the library)
        _loaded = "<already registered>"
        return _loaded
    directory = build_dir()
    path = directory / f"{NAME}.so"
    if (directory / "complete").is_file() and path.is_file():
        torch.ops.load_library(str(path))
    else:
        path = _build(directory)  # cpp_extension.load loads it too
    if not is_loaded():
        raise PluginBuildError(f"{path} was loaded but did not register torch.ops.{NAME}.paged_attention")
    # Global, so that an engine loaded later resolves the ops' C shims (c_shims.py) from it.
    ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    _loaded = str(path)
    return _loaded


def ensure_built() -> str:
    """The pre-build hook (`python -m kiln.plugins.cpp`): build now instead of on first use."""
    return load()


def paged_attention_op():
    return op("paged_attention")


def op(name: str):
    """`torch.ops.kiln_cpp.<name>`, loading the library first."""
    load()
    return getattr(torch.ops.kiln_cpp, name)


def gemm_op():
    """`torch.ops.kiln_cpp.gemm` (csrc/gemm.cpp)."""
    return op("gemm")


def kernel_capability() -> str:
    """Which build of the kernel runs on this CPU: "AVX512", "AVX2" or "DEFAULT"."""
    load()
    return torch.ops.kiln_cpp.kernel_capability()


if __name__ == "__main__":
    print(ensure_built())
    print(f"kernel: {kernel_capability()}", file=sys.stderr)
