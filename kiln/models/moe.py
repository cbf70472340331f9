"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) on the fused `kiln_cpp::moe` plugin.

The router's logits come from the GEMM plugin in the model dtype (inside the plugin's `moe_gated`
where the router is packed, else from the model's Linear); `moe_gated` and `moe_routed` route on
them exactly as HF does: a float32 softmax over all experts, top-k, optionally renormalized
(moe.normalization_mode), cast back to the model dtype. The experts this rank holds
(kiln/layout.py) are packed per expert for the C++ GEMM and stacked; the plugin groups the
step's tokens by expert and runs each chosen expert once over its tokens. A shared expert
(Qwen2-MoE) is a dense MLP on every token, scaled by sigmoid(x . shared_expert_gate). The layer
returns this rank's partial sum; the caller's all-reduce completes it across ranks.
"""
import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ConfigError, PretrainedConfig, torch_dtype
from kiln.layout import SHARED, expert_range
from kiln.models.linear import Linear, PackedLinear, make_linear, quant_algo_of, stacked, tensor_specs
from kiln.plugins import gemm, quant

EXPERT_ALGOS = (None, "W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ", "FP8")  # AWQ: without pre-quant scales


def moe_tensor_specs(config: PretrainedConfig, prefix: str, rank: int,
                     optional: bool = False) -> dict[str, tuple[tuple, object]]:
    """name -> (shape, kind) of a MoE layer's MLP tensors on a rank (prefix: transformer.layers.{i}.);
    optional as linear.tensor_specs'."""
    m, hidden = config.mapping, config.hidden_size
    inter, experts = config.moe_intermediate_size // m.moe_tp_size, config.experts_per_rank
    specs = {prefix + "mlp.router.weight": ((config.moe.num_experts, hidden), "model")}
    for name, out, inp in (("mlp.fc", 2 * inter, hidden), ("mlp.proj", hidden, inter)):
        for key, spec in tensor_specs(config, prefix + name, out, inp, optional).items():
            per_tensor = key.endswith(("activation_scaling_factor", "prequant_scaling_factor", "_2"))
            specs[key] = spec if per_tensor else stacked(spec, experts)
    shared = config.moe.shared_expert_intermediate_size // m.tp_size
    if shared:
        for name, out, inp in ((SHARED[0], shared, hidden), (SHARED[1], shared, hidden), (SHARED[2], hidden, shared)):
            specs.update(tensor_specs(config, prefix + name, out, inp, optional))
        specs[prefix + "mlp.shared_expert_gate.weight"] = ((1, hidden), "model")
    return specs


def _gate_first(t: torch.Tensor) -> torch.Tensor:
    """An expert's fc rows (or their scales) [up; gate] -> [gate; up], what silu_and_mul reads."""
    up, gate = t.chunk(2, dim=0)
    return torch.cat([gate, up])


def _packed_experts(config: PretrainedConfig, weights: dict, name: str, n: int, k: int) -> PackedLinear:
    """The rank's experts of linear `name` (mlp.fc or mlp.proj), each packed, stacked [experts, ...];
    fc's rows reordered gate first."""
    algo, g, dtype = quant_algo_of(config, name), config.quantization.group_size, torch_dtype(config.dtype)
    order = _gate_first if name.endswith("mlp.fc") else (lambda t: t)
    if algo not in EXPERT_ALGOS:
        raise ConfigError(f"quant_algo {algo} is not supported for a mixture of experts' experts; expected "
                          f"unquantized, W8A16, W4A16 or FP8 (convert_checkpoint --qformat int8_wo / int4_wo / fp8)")
    w = weights[name + ".weight"]
    for suffix, what in (("prequant_scaling_factor", "pre-quant scales"), ("zero", "zero points"),
                         ("input_index", "act-order input_index")):
        if name + "." + suffix in weights:
            raise ConfigError(f"{name}: {what} on experts are not supported")
    experts = range(w.shape[0])
    if algo is None:
        return PackedLinear(torch.stack([gemm.pack(order(w[e].to(dtype))) for e in experts]), n, k)
    scale = weights[name + ".weights_scaling_factor"]
    if algo == "FP8":  # per-tensor activation scale shared by the experts, one weight scale each
        act = weights[name + ".activation_scaling_factor"].reshape(()).float()
        rows = lambda s: order(s) if s.numel() > 1 else s  # noqa: E731 (a per-channel scale, gate first)
        scales = [gemm.pack_scale(act * rows(scale[e].float().reshape(-1)), n) for e in experts]
        return PackedLinear(torch.stack([gemm.pack(order(w[e])) for e in experts]), n, k, torch.stack(scales),
                            act_scale=act, act_dtype=quant.FP8)
    if algo == "W8A16":
        return PackedLinear(torch.stack([gemm.pack(order(w[e])) for e in experts]), n, k,
                            torch.stack([gemm.pack_scale(order(scale[e]), n) for e in experts]))
    parts = [gemm.pack_int4(order(quant.unpack_int4(w[e])), order(scale[e]), g) for e in experts]
    return PackedLinear(torch.stack([p for p, _ in parts]), n, k, torch.stack([s for _, s in parts]), group_size=g)


class MoeMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, weights: dict, prefix: str, rank: int, packed: bool, silu_and_mul):
        super().__init__()
        self.silu_and_mul = silu_and_mul  # the shared expert's
        m, hidden = config.mapping, config.hidden_size
        dtype = torch_dtype(config.dtype)
        router = weights[prefix + "mlp.router.weight"].to(dtype)
        # On the plugin's GEMV: ATen's bf16 one took 30 us for Qwen3-MoE's 128 x 512 router, a serial
        # stretch per layer long enough that the idle pool threads went to sleep (woken, late, each layer).
        self.router = PackedLinear(gemm.pack(router), *router.shape) if packed else Linear(router)
        self.top_k, self.renormalize = config.moe.top_k, config.moe.normalization_mode == 1
        self.inter = config.moe_intermediate_size // m.moe_tp_size
        self.expert_start = expert_range(config, m.tp_rank(rank)).start
        # PackedLinears so that engine-build times their kernels like any GEMM's (per expert's rows).
        self.fc = _packed_experts(config, weights, prefix + "mlp.fc", 2 * self.inter, hidden)
        self.proj = _packed_experts(config, weights, prefix + "mlp.proj", hidden, self.inter)
        # How the plugin runs them, for engine-build's timing: fc activated in its epilogue, and each
        # expert on one thread where a token's experts outnumber the threads.
        self.fc.swiglu = True
        self.fc.experts_per_token = self.proj.experts_per_token = self.top_k
        self.shared_gate_up = self.shared_proj = self.shared_gate = None
        if config.moe.shared_expert_intermediate_size:
            self.shared_gate_up = make_linear(config, weights, [prefix + SHARED[0], prefix + SHARED[1]], None, packed)
            self.shared_proj = make_linear(config, weights, [prefix + SHARED[2]], None, packed)
            self.shared_gate = nn.Parameter(weights[prefix + "mlp.shared_expert_gate.weight"].to(dtype),
                                            requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kiln.plugins import cpp

        fc, proj, router = self.fc, self.proj, self.router
        experts = (fc.weight, fc.scale, proj.weight, proj.scale, self.expert_start, self.inter, fc.group_size,
                   _tactics(fc), _tactics(proj), proj.act_scale)
        if isinstance(router, PackedLinear) and fc.act_scale is None:  # the router GEMM inside the op
            out = cpp.op("moe_gated")(x, router.weight, router.n, _tactics(router), self.top_k, self.renormalize,
                                      *experts)
        else:  # FP8 experts take x on their grid, the router x itself
            xq = x if fc.act_scale is None else quant.quantize_to(x, fc.act_scale, fc.act_dtype).to(x.dtype)
            out = cpp.op("moe_routed")(xq, router(x), self.top_k, self.renormalize, *experts)
        if self.shared_gate is not None:
            shared = self.shared_proj(self.silu_and_mul(self.shared_gate_up(x)))
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out


def _tactics(layer: PackedLinear) -> list[int]:
    # Never an empty list: AOTInductor's proxy executor passes an empty int[] constant as None.
    return list(layer.tactics) or [1 << 62, 0]  # every token count: Kernel::Auto
