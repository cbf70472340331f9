"""The op set a model is built on: per group of ops, the kernel family that runs it, chosen once
when the engine is built (`choose`, from TensorRT-LLM's plugin settings) and recorded in its build
config as `op_set`. The model calls the op set and never asks which family it got.

A family is a `Kernels` (base.py): plain torch, Python plugin nodes, the C++ CPU plugins, or the
OpenAI Triton kernels of the GPU (gpu.py).
"""
from torch import nn

from kiln.config import ConfigError, PretrainedConfig
from kiln.models.ops.base import AttentionLayer, Kernels
from kiln.models.ops.cpp import CppKernels
from kiln.models.ops.gpu import TritonKernels
from kiln.models.ops.reference import PythonPluginKernels, TorchKernels

FAMILIES: dict[str, type[Kernels]] = {"inline": TorchKernels, "python": PythonPluginKernels, "cpp": CppKernels,
                                      "triton": TritonKernels}
# group -> the TensorRT-LLM plugin setting that picks its family
GROUPS = {"attention": "gpt_attention_plugin", "gemm": "gemm_plugin", "norm": "rmsnorm_plugin",
          "rotary": "rope_plugin", "activation": "swiglu_plugin"}


def choose(plugin_config: dict) -> dict[str, str]:
    """The family of each group for a build's resolved plugin settings (kiln/build/settings.py)."""
    chosen = {group: plugin_config.get(key) or "inline" for group, key in GROUPS.items()}
    if chosen["gemm"] not in ("cpp", "triton"):  # no Python GEMM node: ATen's GEMMs
        chosen["gemm"] = "inline"
    return chosen


class OpSet:
    """The ops of one engine's forward: attention from a layer's QKV projection, norms, rotary, the
    gated activations, linears (quantized or not), LoRA's per-token updates."""

    def __init__(self, choices: dict[str, str]):
        unknown = {g: f for g, f in choices.items() if g not in GROUPS or f not in FAMILIES}
        if unknown or set(choices) != set(GROUPS):
            raise ConfigError(f"op_set {choices!r} is not valid; expected a family among {', '.join(FAMILIES)} "
                              f"for each of {', '.join(GROUPS)}")
        self.choices = dict(choices)
        families = {name: FAMILIES[name]() for name in set(choices.values()) | {"inline"}}
        reference = families["inline"]

        def of(group, op):
            return getattr(families[choices[group]], op) or getattr(reference, op)

        self.attention_family = families[choices["attention"]]
        self.kv_cache_write = of("attention", "kv_cache_write")
        self.paged_attention = of("attention", "paged_attention")
        self.rms_norm = of("norm", "rms_norm")
        self.fused_add_rms_norm = of("norm", "fused_add_rms_norm")
        self.rotary_embedding = of("rotary", "rotary_embedding")
        self.silu_and_mul = of("activation", "silu_and_mul")
        self.gelu_tanh_and_mul = of("activation", "gelu_tanh_and_mul")  # traced inline: no plugin has GeGLU
        self.gemm_family = families[choices["gemm"]]
        self.packed_gemm = self.gemm_family.packed_gemm

    def act_and_mul(self, hidden_act: str):
        """The gated MLP's activation: GeGLU for Gemma, SwiGLU for the rest."""
        return self.gelu_tanh_and_mul if hidden_act == "gelu_pytorch_tanh" else self.silu_and_mul

    def fused_attention(self, layer: AttentionLayer):
        return self.attention_family.fused_attention(layer)

    def linear(self, config: PretrainedConfig, weights: dict, names: list[str], bias=None) -> nn.Module:
        return self.gemm_family.linear(config, weights, names, bias)

    def moe(self, config: PretrainedConfig, weights: dict, prefix: str, rank: int) -> nn.Module:
        return self.gemm_family.moe(config, weights, prefix, rank, self.silu_and_mul)

    def lora(self, slots, ranks, pools):
        return self.gemm_family.lora(slots, ranks, pools)
