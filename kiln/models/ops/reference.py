"""The plain-torch family: the ops traced inline, for the graph compiler to fuse (kiln/plugins/cpu.py),
and linears on ATen's GEMMs. Every other family is held to it (kiln/plugins/reference.py is its spec)."""
from kiln.models.ops.base import Kernels
from kiln.plugins import cpu


class TorchKernels(Kernels):
    kv_cache_write = staticmethod(cpu.kv_cache_write)
    paged_attention = staticmethod(cpu.paged_attention)
    rms_norm = staticmethod(cpu.rms_norm)
    fused_add_rms_norm = staticmethod(cpu.fused_add_rms_norm)
    rotary_embedding = staticmethod(cpu.rotary_embedding)
    silu_and_mul = staticmethod(cpu.silu_and_mul)
    gelu_tanh_and_mul = staticmethod(cpu.gelu_tanh_and_mul)


class PythonPluginKernels(Kernels):
    """kiln:: custom-op nodes in the graph (kiln/plugins/ops.py): opaque to the compiler, run by
    Python. For debugging a plugin boundary; an engine using them runs only where kiln is imported."""

    def __init__(self):
        from kiln.plugins import ops

        for op in ("kv_cache_write", "paged_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding",
                   "silu_and_mul"):
            setattr(self, op, getattr(ops, op))
