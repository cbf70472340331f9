"""Backends turn one rank's ExportedProgram into a serialized engine file (loaded back by
kiln/engine/loader.py)."""
import os
import tempfile
import warnings
from pathlib import Path

import torch


def compile_aoti(program, path: Path, max_autotune: bool) -> list[str]:
    """Returns the declarations of the kiln_cpp ops' C shims the engine calls (kiln/plugins/c_shims.py)."""
    from kiln.plugins import c_shims

    configs = {"max_autotune": max_autotune, "max_autotune_gemm_backends": "CPP,ATEN"} if max_autotune else {}
    shims = c_shims.for_program(program)
    if shims:
        configs["aot_inductor.custom_ops_to_c_shims"] = shims
    # AOTInductor insists on a .pt2 name; the engine dir calls it rank{N}.engine.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        package = Path(tmp) / "model.pt2"
        with warnings.catch_warnings():  # torch's own deprecation, raised by its own pickling of tree specs
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=configs)
        os.replace(package, path)
    return sorted(d for declared in shims.values() for d in declared)


def compile_eager(program, path: Path, max_autotune: bool) -> list[str]:
    with open(path, "wb") as f:  # a file object: torch.export wants a .pt2 name otherwise
        torch.export.save(program, f)
    return []


COMPILERS = {"aoti": compile_aoti, "eager": compile_eager}
