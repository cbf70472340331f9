"""The kiln_cpp ops' C shims (csrc/c_shim.h): an aoti engine calls each op through a C function of
its own, `aoti_torch_cpu_<op>`, as it calls ATen's, instead of through AOTInductor's proxy executor.

At build, `for_program` hands AOTInductor the declarations of the shims of the ops the program
calls (`aot_inductor.custom_ops_to_c_shims`); the engine's config records them (build_config
`c_shims`), and `check` refuses at load an engine whose shims this library declares otherwise: a
call through a changed signature would not fail, it would pass wrong arguments. The engine resolves
the shims when it is loaded, from the library, which `cpp.load` makes global for that.
"""
from __future__ import annotations

import ctypes
import os

import torch

from kiln.config import ConfigError
from kiln.plugins import cpp

PREFIX = "aoti_torch_cpu_"


def declarations() -> dict[str, str]:
    """{op name: "AOTITorchError aoti_torch_cpu_<op>(...)"} for the shims this library defines and
    this process resolves to it (a name that a library loaded before it also defines is left to
    the proxy executor)."""
    path = cpp.load()
    declared = {d[d.index(PREFIX) + len(PREFIX):d.index("(")]: d for d in torch.ops.kiln_cpp.c_shims()}
    try:
        ours, everyone = ctypes.CDLL(path), ctypes.CDLL(None)
    except OSError:  # registered by a library of unknown path: only the proxy executor is safe
        return {}
    return {op: d for op, d in declared.items() if _address(everyone, op) == _address(ours, op) is not None}


def _address(library, op: str) -> int | None:
    try:
        return ctypes.cast(getattr(library, PREFIX + op), ctypes.c_void_p).value
    except AttributeError:
        return None


def for_program(program) -> dict:
    """{OpOverload: [declaration]} for the kiln_cpp ops `program` calls that have a shim; none with
    $KILN_C_SHIMS=0 (every op through the proxy executor, for A/B measurements)."""
    choice = os.environ.get("KILN_C_SHIMS", "1")
    if choice not in ("0", "1"):
        raise ValueError(f"KILN_C_SHIMS must be 0 or 1, got {choice!r}")
    if choice == "0":
        return {}
    used = {node.target for node in program.graph.nodes
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace == "kiln_cpp"}
    if not used:
        return {}
    shims = declarations()
    return {op: [shims[op._opname]] for op in sorted(used, key=str) if op._opname in shims}


def check(recorded: list[str] | None, engine: str) -> None:
    """Raises ConfigError if the engine's recorded shims are not all this library's."""
    missing = sorted(set(recorded or ()) - set(declarations().values()))
    if missing:
        raise ConfigError(
            f"{engine} calls kiln_cpp ops through C functions that this kiln's plugins no longer declare "
            f"alike ({'; '.join(missing)}); rebuild the engine with `engine-build`")
