"""The C++ CPU plugins (kiln/plugins/csrc, `torch.ops.kiln_cpp`): nodes AOTInductor calls without Python."""
from kiln.models.ops.base import AttentionLayer, Kernels
from kiln.plugins import cpp, cpu


class CppKernels(Kernels):
    # The KV write stays inline beside the C++ attention: one index_put_ on the pool, compiled in place.
    kv_cache_write = staticmethod(cpu.kv_cache_write)
    packed_gemm = True

    def __init__(self):
        self.paged_attention = cpp.paged_attention_op()
        self._attention = cpp.op("attention")
        for op in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"):  # csrc/elementwise.cpp
            setattr(self, op, cpp.op(op))

    def fused_attention(self, layer: AttentionLayer):
        # csrc/attention.cpp keeps a float pool and norms q/k per head; other layers take the split path
        if not layer.rotary or layer.quantized_kv or layer.qk_norm == "projection":
            return None
        return self._attention
