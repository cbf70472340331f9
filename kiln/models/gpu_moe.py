"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) on the Triton fused MoE (kiln_gpu::fused_moe).

Semantics are MoeMLP's (kiln/models/moe.py), which are HF's: the router is a plain linear in the
model dtype, routed in torch (a float32 softmax over all experts, top-k, optionally renormalized,
cast back to the model dtype); the experts this rank holds (kiln/layout.py) run in one grouped GEMM
launch per projection, with their fc rows reordered gate first; a shared expert (Qwen2-MoE) is a
dense MLP on silu_and_mul and the GPU linears (gpu_linear.py), scaled by
sigmoid(x . shared_expert_gate). The layer returns this rank's partial sum; the caller's all-reduce
completes it across ranks. Routing stays in torch (small [T, experts] ops the graph compiler fuses);
the experts are the step's big GEMMs.
"""
import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ConfigError, PretrainedConfig, torch_dtype
from kiln.layout import SHARED, expert_range
from kiln.models.gpu_linear import make_linear
from kiln.models.linear import quant_algo_of
from kiln.models.moe import _gate_first

EXPERT_ALGOS = (None, "W8A16")


def _experts(config: PretrainedConfig, weights: dict, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [experts, out, in], per-channel scale [experts, out] or None) of the rank's experts of
    linear `name` (mlp.fc or mlp.proj), fc's rows (and scales) gate first."""
    algo = quant_algo_of(config, name)
    if algo not in EXPERT_ALGOS:
        raise ConfigError(f"quant_algo {algo} is not supported for a mixture of experts' experts on the Triton "
                          f"kernels; expected unquantized or W8A16 (convert_checkpoint --qformat int8_wo)")
    if any(key.startswith(name + ".prequant") for key in weights):
        raise ConfigError(f"{name}: pre-quant scales on experts are not supported")
    if name + ".input_index" in weights:
        raise ConfigError(f"{name}: act-order input_index on experts is not supported")
    order = _gate_first if name.endswith("mlp.fc") else (lambda t: t)
    w = weights[name + ".weight"]
    if algo is None:
        return torch.stack([order(e) for e in w.to(torch_dtype(config.dtype))]).contiguous(), None
    scale = weights[name + ".weights_scaling_factor"]
    return (torch.stack([order(e) for e in w.to(torch.int8)]).contiguous(),
            torch.stack([order(s) for s in scale.float()]).contiguous())


class TritonMoeMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, weights: dict, prefix: str, rank: int, silu_and_mul):
        super().__init__()
        from kiln.plugins.gpu import moe  # noqa: F401 (registers kiln_gpu::fused_moe)

        self.silu_and_mul = silu_and_mul  # the shared expert's
        m, dtype = config.mapping, torch_dtype(config.dtype)
        self.router = nn.Parameter(weights[prefix + "mlp.router.weight"].to(dtype), requires_grad=False)
        self.top_k, self.renormalize = config.moe.top_k, config.moe.normalization_mode == 1
        self.expert_start = expert_range(config, m.tp_rank(rank)).start
        fc, fc_scale = _experts(config, weights, prefix + "mlp.fc")
        proj, proj_scale = _experts(config, weights, prefix + "mlp.proj")
        self.fc = nn.Parameter(fc, requires_grad=False)
        self.proj = nn.Parameter(proj, requires_grad=False)
        self.register_buffer("fc_scale", fc_scale)
        self.register_buffer("proj_scale", proj_scale)
        self.shared_gate_up = self.shared_proj = self.shared_gate = None
        if config.moe.shared_expert_intermediate_size:
            self.shared_gate_up = make_linear(config, weights, [prefix + SHARED[0], prefix + SHARED[1]])
            self.shared_proj = make_linear(config, weights, [prefix + SHARED[2]])
            self.shared_gate = nn.Parameter(weights[prefix + "mlp.shared_expert_gate.weight"].to(dtype),
                                            requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k expert ids [T, k], their weights [T, k] in the model dtype), as HF routes."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = torch.ops.kiln_gpu.fused_moe(x, ids, weights, self.fc, self.proj, self.fc_scale, self.proj_scale,
                                           self.expert_start)
        if self.shared_gate is not None:
            shared = self.shared_proj(self.silu_and_mul(self.shared_gate_up(x)))
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out
