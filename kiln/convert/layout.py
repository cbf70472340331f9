"""The linears of one layer by TensorRT-LLM name: their shapes, and the part of each that a
tensor-parallel rank holds. Arithmetic on the config only (no torch), so that the converter's options
are checked against it before anything heavy is imported."""
from kiln.config import PretrainedConfig

COLUMN_PARALLEL = ("attention.qkv", "mlp.fc", "mlp.gate")
ROW_PARALLEL = ("attention.dense", "mlp.proj")


def kv_head_range(cfg: PretrainedConfig, tp_rank: int) -> range:
    """The KV heads a tp rank holds: an even split, or one replicated head when tp > kv_heads."""
    tp, kv = cfg.mapping.tp_size, cfg.num_key_value_heads
    if tp <= kv:
        per = kv // tp
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank // (tp // kv)
    return range(head, head + 1)


def linear_shapes(cfg: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear of one layer, by its TensorRT-LLM name."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * cfg.head_size, cfg.num_key_value_heads * cfg.head_size
    return {"attention.qkv": (q_out + 2 * kv_out, h), "attention.dense": (h, q_out),
            "mlp.fc": (inter, h), "mlp.gate": (inter, h), "mlp.proj": (h, inter)}


def output_ranges(cfg: PretrainedConfig, linear: str, tp_rank: int) -> list[tuple[int, int]]:
    """The output rows of a column-parallel linear that tp rank `tp_rank` holds."""
    tp, hd = cfg.mapping.tp_size, cfg.head_size
    if linear == "attention.qkv":
        q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        per_q, kv = cfg.heads_per_rank * hd, kv_head_range(cfg, tp_rank)
        return [(tp_rank * per_q, (tp_rank + 1) * per_q),
                (q_out + kv.start * hd, q_out + kv.stop * hd),
                (q_out + kv_out + kv.start * hd, q_out + kv_out + kv.stop * hd)]
    part = cfg.intermediate_size // tp
    return [(tp_rank * part, (tp_rank + 1) * part)]
