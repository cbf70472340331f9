"""Backends turn one rank's ExportedProgram into a serialized engine file, and load it back."""
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.utils._pytree as pytree


def compile_aoti(program, path: Path, max_autotune: bool) -> None:
    configs = {"max_autotune": max_autotune, "max_autotune_gemm_backends": "CPP,ATEN"} if max_autotune else {}
    # AOTInductor insists on a .pt2 name; the engine dir calls it rank{N}.engine.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        package = Path(tmp) / "model.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=configs)
        os.replace(package, path)


def compile_eager(program, path: Path, max_autotune: bool) -> None:
    with open(path, "wb") as f:  # a file object: torch.export wants a .pt2 name otherwise
        torch.export.save(program, f)


COMPILERS = {"aoti": compile_aoti, "eager": compile_eager}


def uses_cpp_plugins(engine_dir: Path) -> bool:
    """Whether the engine in engine_dir was built with a C++ plugin (kiln_cpp:: ops in its graph)."""
    try:
        plugins = json.loads((Path(engine_dir) / "config.json").read_text())["build_config"]["plugin_config"]
        return "cpp" in plugins.values()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


class AOTIModel:
    """Runs a loaded AOTInductor package on keyword arguments, as torch's AOTICompiledModel does, but
    without importing torch.export's serializer and with it dynamo: 1.4 s of CPU that a process
    loading only an engine need not spend."""

    def __init__(self, loader):
        self.loader = loader
        in_spec, self.out_spec = (pytree.treespec_loads(spec) for spec in loader.get_call_spec())
        self.input_names = in_spec.child(1).context  # the order the package takes its keyword arguments in

    def __call__(self, **inputs):
        flat = self.loader.boxed_run([inputs[name] for name in self.input_names])
        return pytree.tree_unflatten(flat, self.out_spec)


def load(backend: str, path: Path, unpacked: Path | None = None):
    """A callable taking the step inputs as keyword arguments and returning logits.

    unpacked: for aoti, a folder holding the files of the package at path
    (kiln.runtime.extraction), which AOTInductor's loader runs from without writing anything;
    without it the loader unpacks the package into $TMPDIR itself."""
    import kiln.plugins  # noqa: F401  (registers the kiln:: ops the engine calls)

    if uses_cpp_plugins(Path(path).parent):
        from kiln.plugins import cpp

        cpp.ensure_built()  # registers the kiln_cpp:: ops (building them once if this machine has not)
    if backend == "aoti":
        # The loader itself: aoti_load_package cannot take a folder, and given a file object (a
        # path would have to end in .pt2) it first copies the whole package to a temporary file.
        return AOTIModel(torch._C._aoti.AOTIModelPackageLoader(str(unpacked or path), "model", False, 1, -1))
    if backend == "eager":
        with open(path, "rb") as f:
            return torch.export.load(f).module()
    raise ValueError(f"unknown backend {backend!r}")
