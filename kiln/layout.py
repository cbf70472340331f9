"""The linears of one layer by TensorRT-LLM name: their shapes, and the part of each that a
tensor-parallel rank holds. Arithmetic on the config only (no torch), so that the converter's options
are checked against it before anything heavy is imported.

A mixture-of-experts layer (config.is_moe_layer) has TensorRT-LLM's MoE linears instead of the dense
MLP: mlp.router [experts, hidden] (replicated, never quantized), mlp.fc [experts, 2 * inter, hidden]
(each expert's up rows then its gate rows) and mlp.proj [experts, hidden, inter], and, where the
model has one, a shared expert named like a dense MLP under mlp.shared_expert plus its sigmoid gate
mlp.shared_expert_gate [1, hidden]. A rank holds its expert-parallel group's experts, each split
along inter across the moe_tp_size ranks of the group; the shared expert splits as a dense MLP."""
from kiln.config import PretrainedConfig

SHARED = ("mlp.shared_expert.fc", "mlp.shared_expert.gate", "mlp.shared_expert.proj")
COLUMN_PARALLEL = ("attention.qkv", "mlp.fc", "mlp.gate", SHARED[0], SHARED[1])
ROW_PARALLEL = ("attention.dense", "mlp.proj", SHARED[2])
EXPERT_LINEARS = ("mlp.fc", "mlp.proj")  # [experts, out, in] in a MoE layer


def kv_head_range(cfg: PretrainedConfig, tp_rank: int) -> range:
    """The KV heads a tp rank holds: an even split, or one replicated head when tp > kv_heads."""
    tp, kv = cfg.mapping.tp_size, cfg.num_key_value_heads
    if tp <= kv:
        per = kv // tp
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank // (tp // kv)
    return range(head, head + 1)


def linear_shapes(cfg: PretrainedConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear of layer `layer`, by its TensorRT-LLM name (per expert for experts)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * cfg.head_size, cfg.num_key_value_heads * cfg.head_size
    shapes = {"attention.qkv": (q_out + 2 * kv_out, h), "attention.dense": (h, q_out)}
    if not cfg.is_moe_layer(layer):
        return {**shapes, "mlp.fc": (inter, h), "mlp.gate": (inter, h), "mlp.proj": (h, inter)}
    moe = cfg.moe_intermediate_size
    shapes.update({"mlp.fc": (2 * moe, h), "mlp.proj": (h, moe)})
    shared = cfg.moe.shared_expert_intermediate_size
    if shared:
        shapes.update({SHARED[0]: (shared, h), SHARED[1]: (shared, h), SHARED[2]: (h, shared)})
    return shapes


def layer_kinds(cfg: PretrainedConfig) -> dict[str, int]:
    """One layer of each kind the model has, by a name prefix: "" a dense one, "moe " a MoE one."""
    return {("moe " if cfg.is_moe_layer(i) else ""): i for i in range(cfg.num_hidden_layers)}


def all_linear_shapes(cfg: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """linear_shapes of every kind of layer the model has (a dense and a MoE one, where both are)."""
    return {kind + name: shape for kind, i in layer_kinds(cfg).items() for name, shape in linear_shapes(cfg, i).items()}


def expert_range(cfg: PretrainedConfig, tp_rank: int) -> range:
    """The experts a tp rank holds: its expert-parallel group's share."""
    per, ep_rank = cfg.experts_per_rank, tp_rank // cfg.mapping.moe_tp_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def output_ranges(cfg: PretrainedConfig, linear: str, tp_rank: int, layer: int = 0) -> list[tuple[int, int]]:
    """The output rows of a column-parallel linear that tp rank `tp_rank` holds (per expert for experts)."""
    tp, hd = cfg.mapping.tp_size, cfg.head_size
    if linear == "attention.qkv":
        q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        per_q, kv = cfg.heads_per_rank * hd, kv_head_range(cfg, tp_rank)
        return [(tp_rank * per_q, (tp_rank + 1) * per_q),
                (q_out + kv.start * hd, q_out + kv.stop * hd),
                (q_out + kv_out + kv.start * hd, q_out + kv_out + kv.stop * hd)]
    if linear == "mlp.fc" and cfg.is_moe_layer(layer):  # up rows, then gate rows
        inter, t = cfg.moe_intermediate_size, cfg.mapping.moe_tp_size
        r, part = tp_rank % t, cfg.moe_intermediate_size // t
        return [(r * part, (r + 1) * part), (inter + r * part, inter + (r + 1) * part)]
    size = cfg.moe.shared_expert_intermediate_size if linear in SHARED else cfg.intermediate_size
    part = size // tp
    return [(tp_rank * part, (tp_rank + 1) * part)]


def input_split(cfg: PretrainedConfig, linear: str, layer: int = 0) -> int:
    """How many parts a row-parallel linear's input dim is split into (1: not split)."""
    if linear == "mlp.proj" and cfg.is_moe_layer(layer):
        return cfg.mapping.moe_tp_size
    return cfg.mapping.tp_size if linear in ROW_PARALLEL else 1
