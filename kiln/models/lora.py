"""LoRA adapters inside the compiled step (TensorRT-LLM's module names and ids).

An engine built with a LoRA plugin takes, beside the step's tokens, each token's adapter slot
(`lora_slots`, -1 for the base model), each slot's adapter rank (`lora_ranks`, 0: empty) and one pool
tensor per target module: [layers of the stage, slots, max_lora_rank, in + out], a slot's row r
holding A's row r (its input dims) then B's column r (its output dims, alpha / r folded in), zero past
the adapter's rank. Every linear a module targets adds, for each token, B_s (A_s x) of its slot s, in
one of two ways (`StepAdapters`):
- segmented (with the C++ GEMM plugin): kiln_cpp::lora (csrc/lora.cpp) reads and computes only each
  token's own adapter, over its rank, with the tokens sorted by slot, as punica / S-LoRA do; tokens
  of the base model cost a copy;
- dense (traced inline, for the compiler): all slots' A at once (one GEMM, [T, slots * rank]), the
  ranks of other slots zeroed per token, then all slots' B (one GEMM).
Either way a batch mixing adapters and base requests is one step.

Tensor parallelism splits B by output rows for the column-parallel modules and A by input columns
for the row-parallel ones (attn_dense, mlp_4h_to_h), whose partial products the block's all-reduce
sums with the base GEMM's.
"""
import torch
import torch.nn.functional as F

from kiln.config import ConfigError, PretrainedConfig

# TensorRT-LLM's LoRA module ids (tensorrt_llm/lora_manager.py, cpp loraModule.h), for the modules of
# Kiln's dense decoder; HF's PEFT names map onto them (gate_proj is the activated branch, mlp_h_to_4h).
MODULE_IDS = {"attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4, "mlp_h_to_4h": 5, "mlp_4h_to_h": 6,
              "mlp_gate": 7}
HF_MODULES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
              "gate_proj": "mlp_h_to_4h", "up_proj": "mlp_gate", "down_proj": "mlp_4h_to_h"}
ROW_PARALLEL = ("attn_dense", "mlp_4h_to_h")


def module_shapes(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """Each module's (in, out) on one tensor-parallel rank."""
    h, d, tp = config.hidden_size, config.head_size, config.mapping.tp_size
    q, kv, inter = config.heads_per_rank * d, config.kv_heads_per_rank * d, config.intermediate_size // tp
    return {"attn_q": (h, q), "attn_k": (h, kv), "attn_v": (h, kv), "attn_dense": (q, h),
            "mlp_h_to_4h": (h, inter), "mlp_gate": (h, inter), "mlp_4h_to_h": (inter, h)}


def check_lora_config(lora_config: dict, config: PretrainedConfig) -> None:
    modules, rank = lora_config.get("lora_target_modules"), lora_config.get("max_lora_rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError(f"max_lora_rank must be an integer >= 1, got {rank!r}")
    if not modules or any(m not in MODULE_IDS for m in modules) or len(set(modules)) != len(modules):
        raise ConfigError(f"lora_target_modules {modules!r} is not supported; expected distinct names among "
                          f"{', '.join(MODULE_IDS)}")
    if config.moe.num_experts:
        raise ConfigError("LoRA on mixture-of-experts models is not supported yet")
    mlp = sorted(m for m in modules if m.startswith("mlp_"))
    if mlp and config.quantization.mlp_channels_by_group:
        raise ConfigError(f"lora_target_modules {', '.join(mlp)}: this checkpoint's MLP channels are in its act-order "
                          f"(desc_act) groups' order, split over tp ranks, and adapters are not; target attention "
                          f"only, or convert it with --tp_size 1")


class StepAdapters:
    """One step's LoRA inputs. `self(i, out, x, (module, column), ...)`: the output `out` of a linear
    of input x at the stage's layer i, plus the updates of the listed modules, whose outputs sit at
    those columns of out (q, k and v of the fused qkv; the two halves of gate_up). Row-parallel
    modules add this rank's partial product, summed with the GEMM's by the block's all-reduce."""

    def __init__(self, slots: torch.Tensor, ranks: torch.Tensor, pools: dict, segmented: bool):
        self.slots, self.ranks, self.pools, self.segmented = slots, ranks, pools, segmented
        if not segmented:
            pool = next(iter(pools.values()))
            self.mask = slot_mask(slots, pool.shape[1], pool.dtype)

    def __call__(self, i: int, out: torch.Tensor, x: torch.Tensor, *columns: tuple[str, int]) -> torch.Tensor:
        present = [(self.pools[m][i], c) for m, c in columns if m in self.pools]
        if not present:
            return out
        if self.segmented:
            return torch.ops.kiln_cpp.lora(out, x, self.slots, self.ranks, [p for p, _ in present],
                                           [c for _, c in present])
        for pool, c in present:
            d = delta(x, self.mask, pool, x.shape[-1])
            out = out + F.pad(d, (c, out.shape[-1] - c - d.shape[-1]))
        return out


class StepLora:
    """The step's adapters, shared by the model's adapted linears: the forward sets them once a step."""

    def __init__(self, modules):
        self.modules = frozenset(modules)
        self.adapters: StepAdapters | None = None


class AdaptedLinear(torch.nn.Module):
    """A linear plus the LoRA updates of its modules, at their output columns."""

    def __init__(self, linear: torch.nn.Module, layer: int, columns: list[tuple[str, int]], step: StepLora):
        super().__init__()
        self.linear, self.layer, self.columns, self.step = linear, layer, columns, step

    def forward(self, x):
        return self.step.adapters(self.layer, self.linear(x), x, *self.columns)


def adapted(linear: torch.nn.Module, layer: int, columns: list[tuple[str, int]], step: StepLora | None):
    """`linear` as it runs in an engine whose LoRA targets `step.modules`: adapted where it holds one."""
    targeted = [c for c in columns if step is not None and c[0] in step.modules]
    return AdaptedLinear(linear, layer, targeted, step) if targeted else linear


def slot_mask(lora_slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, slots]: 1 where the token's adapter is that slot (no 1 in a base-model token's row)."""
    return (lora_slots[:, None] == torch.arange(num_slots, device=lora_slots.device)[None, :]).to(dtype)


def delta(x: torch.Tensor, mask: torch.Tensor, pool: torch.Tensor, in_features: int) -> torch.Tensor:
    """Each token's B_s (A_s x) for its slot s; pool: one layer's [slots, rank, in + out]."""
    slots, rank = pool.shape[0], pool.shape[1]
    a = pool[:, :, :in_features].reshape(slots * rank, in_features)  # views: rows strided by in + out
    b = pool[:, :, in_features:].reshape(slots * rank, -1)
    shrunk = F.linear(x.to(pool.dtype), a).view(-1, slots, rank) * mask[:, :, None]
    return (shrunk.view(-1, slots * rank) @ b).to(x.dtype)
