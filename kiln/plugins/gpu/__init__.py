"""The GPU op set's kernels, written in OpenAI Triton: torch ops in the `kiln_gpu` namespace.

Each op is a `torch.library.triton_op`, so AOTInductor compiles its kernels into a CUDA engine the
way it compiles its own, and an exported graph keeps it as one node. Each also registers a fake
(output shapes only): under Triton's interpreter (TRITON_INTERPRET=1, how CI runs these kernels on
CPU tensors) a kernel launches eagerly, so the op's own body cannot stand in for its fake during
export. Kernels compute in float32 and store in the output's dtype (the interpreter has no bfloat16
arithmetic of its own, and neither do the tensor cores' accumulators).

Modules: elementwise (norms, rotary, gated activations), attention (KV write, paged attention),
gemm (weight-only int8/int4 GEMMs), moe (fused experts), lora (shrink / expand).
"""
import importlib
import os

import torch

from kiln.config import ConfigError

MODULES = ("elementwise", "attention", "gemm", "moe", "lora")


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (read by triton when it is first imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_runnable(device: str = "cpu") -> None:
    """A one-line error unless Triton kernels can run on `device` here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ConfigError("the Triton kernels need the triton package: pip install 'kiln-llm[gpu]'") from None
    if device == "cpu" and not interpreted():
        raise ConfigError("Kiln's Triton kernels run on CPU tensors only in Triton's interpreter: set "
                          "TRITON_INTERPRET=1 before starting Python")


def triton_op(name: str, fake, mutates_args=()):
    """Registers the decorated function as kiln_gpu::name, with `fake` for its output shapes."""
    def register(fn):
        op = torch.library.triton_op(f"kiln_gpu::{name}", fn, mutates_args=mutates_args)
        op.register_fake(fake)
        return op
    return register


def load() -> None:
    """Registers every kiln_gpu op (what a loading process does before it deserializes an engine)."""
    for module in MODULES:
        importlib.import_module(f"kiln.plugins.gpu.{module}")
