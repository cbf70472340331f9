"""The GPU family: OpenAI Triton kernels (kiln/plugins/gpu, `torch.ops.kiln_gpu`), which
AOTInductor compiles into a CUDA engine and Triton's interpreter runs on CPU tensors (CI).

Linears are weight-only int8/int4 Triton GEMMs where quantized (dense ones stay on cuBLAS through
ATen), experts one fused grouped GEMM, LoRA per-token shrink/expand kernels."""
from kiln.models.ops.base import Kernels


class TritonKernels(Kernels):
    def __init__(self):
        from kiln.plugins import gpu

        gpu.load()  # (whether they can run here: engine-build and the loader check, for the device they know)
        from kiln.plugins.gpu import attention, elementwise

        self.kv_cache_write, self.paged_attention = attention.kv_cache_write, attention.paged_attention
        for op in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "gelu_tanh_and_mul"):
            setattr(self, op, getattr(elementwise, op))

    def linear(self, config, weights, names, bias=None):
        from kiln.models import gpu_linear

        return gpu_linear.make_linear(config, weights, names, bias)

    def moe(self, config, weights, prefix, rank, silu_and_mul):
        from kiln.models.gpu_moe import TritonMoeMLP

        return TritonMoeMLP(config, weights, prefix, rank, silu_and_mul)

    def lora(self, slots, ranks, pools):
        from kiln.plugins.gpu.lora import TritonAdapters

        return TritonAdapters(slots, ranks, pools)
