"""TensorRT-LLM weight names, and how HF tensors are split across tensor/pipeline-parallel ranks.

A rank's weights are described as a plan: a list of (TensorRT-LLM name, builder) pairs whose
builders read only that rank's slice of each HF tensor. The writer runs one rank's plan at a time,
so peak memory stays near one output shard.

Layout conventions, all as in TensorRT-LLM:
- linear weights are (out, in); column-parallel layers (qkv, fc, gate) split dim 0, row-parallel
  ones (dense, proj) split dim 1;
- qkv is fused per rank as [this rank's q rows; its k rows; its v rows];
- with more ranks than KV heads, each KV head is replicated on tp // kv_heads consecutive ranks;
- embedding and lm_head are padded with zero rows to a multiple of tp and split along vocab;
- layer indices inside a pipeline stage's file are global;
- a mixture of experts' layer stacks its rank's experts (kiln/layout.py), read one expert at a time.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from kiln.config import ConfigError, PretrainedConfig
from kiln.layout import (COLUMN_PARALLEL, EXPERT_LINEARS, ROW_PARALLEL, SHARED, expert_range, input_split,
                                 kv_head_range, linear_shapes, output_ranges)

# A builder takes the open HF weights (kiln.convert.hf.HFWeights) and returns one rank tensor.
Builder = Callable[[object], torch.Tensor]

HF_EMBED = "model.embed_tokens.weight"
HF_NORM = "model.norm.weight"
HF_LM_HEAD = "lm_head.weight"


def hf_layer(i: int, suffix: str) -> str:
    return f"model.layers.{i}.{suffix}"


def trt_layer(i: int, suffix: str) -> str:
    return f"transformer.layers.{i}.{suffix}"


def hf_moe(cfg: PretrainedConfig, i: int, part: str, expert: int | None = None) -> str:
    """The HF name of a MoE layer's router ("router") or of expert `expert`'s "gate", "up" or "down"."""
    if cfg.architecture == "MixtralForCausalLM":
        if part == "router":
            return hf_layer(i, "block_sparse_moe.gate.weight")
        return hf_layer(i, f"block_sparse_moe.experts.{expert}.{dict(gate='w1', up='w3', down='w2')[part]}.weight")
    if part == "router":
        return hf_layer(i, "mlp.gate.weight")
    return hf_layer(i, f"mlp.experts.{expert}.{part}_proj.weight")


def _moe_source_shapes(cfg: PretrainedConfig, i: int) -> dict[str, tuple[int, ...]]:
    h, inter, shared = cfg.hidden_size, cfg.moe_intermediate_size, cfg.moe.shared_expert_intermediate_size
    shapes = {hf_moe(cfg, i, "router"): (cfg.moe.num_experts, h)}
    for e in range(cfg.moe.num_experts):
        shapes.update({hf_moe(cfg, i, "gate", e): (inter, h), hf_moe(cfg, i, "up", e): (inter, h),
                       hf_moe(cfg, i, "down", e): (h, inter)})
    if shared:
        shapes.update({hf_layer(i, "mlp.shared_expert.gate_proj.weight"): (shared, h),
                       hf_layer(i, "mlp.shared_expert.up_proj.weight"): (shared, h),
                       hf_layer(i, "mlp.shared_expert.down_proj.weight"): (h, shared),
                       hf_layer(i, "mlp.shared_expert_gate.weight"): (1, h)})
    return shapes


def source_shapes(cfg: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the conversion reads, with the shape config.json implies for it."""
    h, hd, inter = cfg.hidden_size, cfg.head_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {HF_EMBED: (cfg.vocab_size, h), HF_NORM: (h,)}
    if not cfg.tie_word_embeddings:
        shapes[HF_LM_HEAD] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        layer = {
            **{hf + ".weight": (h,) for _, hf in norms(cfg)},
            "self_attn.q_proj.weight": (q_out, h),
            "self_attn.k_proj.weight": (kv_out, h),
            "self_attn.v_proj.weight": (kv_out, h),
            "self_attn.o_proj.weight": (h, q_out),
        }
        if cfg.is_moe_layer(i):
            shapes.update(_moe_source_shapes(cfg, i))
        else:
            layer.update({"mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                          "mlp.down_proj.weight": (h, inter)})
        if cfg.attn_bias:
            layer.update({"self_attn.q_proj.bias": (q_out,), "self_attn.k_proj.bias": (kv_out,),
                          "self_attn.v_proj.bias": (kv_out,)})
        if cfg.qk_layernorm:
            whole = cfg.qk_layernorm_scope == "projection"
            layer.update({"self_attn.q_norm.weight": (q_out if whole else hd,),
                          "self_attn.k_norm.weight": (kv_out if whole else hd,)})
        shapes.update({hf_layer(i, k): v for k, v in layer.items()})
    return shapes


# ---------------------------------------------------------------------------------------------
# builders: each reads just the slice one rank needs


def fused_tensors(cfg: PretrainedConfig) -> dict[str, list[tuple[str, int]]]:
    """HF tensors that hold several linears stacked (Phi-3's qkv_proj and gate_up_proj) -> their parts
    by the names the conversion reads, with each part's rows (kiln.convert.hf.HFWeights.unfuse)."""
    if cfg.architecture != "Phi3ForCausalLM":
        return {}
    q, kv = cfg.num_attention_heads * cfg.head_size, cfg.num_key_value_heads * cfg.head_size
    inter = cfg.intermediate_size
    fused = {}
    for i in range(cfg.num_hidden_layers):
        fused[hf_layer(i, "self_attn.qkv_proj.weight")] = [
            (hf_layer(i, f"self_attn.{x}_proj.weight"), rows) for x, rows in (("q", q), ("k", kv), ("v", kv))]
        fused[hf_layer(i, "mlp.gate_up_proj.weight")] = [
            (hf_layer(i, f"mlp.{x}_proj.weight"), inter) for x in ("gate", "up")]
    return fused


def norms(cfg: PretrainedConfig) -> list[tuple[str, str]]:
    """(Kiln name, HF name) of a layer's block norms. HF's post_attention_layernorm is the norm before
    the MLP in a pre-norm model (Kiln's post_layernorm, as TensorRT-LLM's) but the attention output's
    norm where the blocks' outputs are normed (OLMo 2; Gemma 2, which has both, calls the one before
    the MLP pre_feedforward_layernorm)."""
    if not cfg.post_norm:
        return [("input_layernorm", "input_layernorm"), ("post_layernorm", "post_attention_layernorm")]
    pre = [("input_layernorm", "input_layernorm"), ("post_layernorm", "pre_feedforward_layernorm")]
    return (pre if cfg.pre_norm else []) + [("post_attention_layernorm", "post_attention_layernorm"),
                                            ("post_feedforward_layernorm", "post_feedforward_layernorm")]


def _whole(name: str, src) -> torch.Tensor:
    return src.read(name)


def _split(name: str, dim: int, size: int, tp: int, tp_rank: int, src) -> torch.Tensor:
    part = size // tp
    return src.read(name, dim, tp_rank * part, (tp_rank + 1) * part)


def _qkv(cfg: PretrainedConfig, i: int, tp_rank: int, kind: str, src) -> torch.Tensor:
    hd, per_q = cfg.head_size, cfg.heads_per_rank
    kv = kv_head_range(cfg, tp_rank)
    q = src.read(hf_layer(i, f"self_attn.q_proj.{kind}"), 0,
                 tp_rank * per_q * hd, (tp_rank + 1) * per_q * hd)
    k = src.read(hf_layer(i, f"self_attn.k_proj.{kind}"), 0, kv.start * hd, kv.stop * hd)
    v = src.read(hf_layer(i, f"self_attn.v_proj.{kind}"), 0, kv.start * hd, kv.stop * hd)
    return torch.cat([q, k, v], dim=0)


def _qk_norm(cfg: PretrainedConfig, i: int, tp_rank: int, x: str, src) -> torch.Tensor:
    """q_norm / k_norm: one head's weight (every rank the same), or the rank's heads' share of a norm
    over the whole projection (OLMo 2)."""
    name = hf_layer(i, f"self_attn.{x}_norm.weight")
    if cfg.qk_layernorm_scope == "head":
        return src.read(name)
    return src.read(name, 0, *_projection_rows(cfg, x, tp_rank))


def _projection_rows(cfg: PretrainedConfig, x: str, tp_rank: int) -> tuple[int, int]:
    """The rows of the q ("q") or k ("k") projection that a tp rank holds."""
    heads = range(tp_rank * cfg.heads_per_rank, (tp_rank + 1) * cfg.heads_per_rank) if x == "q" \
        else kv_head_range(cfg, tp_rank)
    return heads.start * cfg.head_size, heads.stop * cfg.head_size


def _vocab(cfg: PretrainedConfig, name: str, tp_rank: int, src) -> torch.Tensor:
    # This rank's rows of the zero-padded [vocab_size_padded, hidden] table; only the last
    # ranks' rows can reach past vocab_size.
    part = cfg.vocab_size_padded // cfg.mapping.tp_size
    start, stop = tp_rank * part, (tp_rank + 1) * part
    real = src.read(name, 0, min(start, cfg.vocab_size), min(stop, cfg.vocab_size))
    if real.shape[0] == part:
        return real
    pad = real.new_zeros((part - real.shape[0], cfg.hidden_size))
    return torch.cat([real, pad], dim=0)


def _expert_fc(cfg: PretrainedConfig, i: int, tp_rank: int, src) -> torch.Tensor:
    """[experts of the rank, 2 * inter / moe_tp, hidden]: each expert's up rows, then its gate rows."""
    (a, b), _ = output_ranges(cfg, "mlp.fc", tp_rank, i)
    return torch.stack([torch.cat([src.read(hf_moe(cfg, i, part, e), 0, a, b) for part in ("up", "gate")])
                        for e in expert_range(cfg, tp_rank)])


def _expert_proj(cfg: PretrainedConfig, i: int, tp_rank: int, src) -> torch.Tensor:
    part = cfg.moe_intermediate_size // cfg.mapping.moe_tp_size
    r = tp_rank % cfg.mapping.moe_tp_size
    return torch.stack([src.read(hf_moe(cfg, i, "down", e), 1, r * part, (r + 1) * part)
                        for e in expert_range(cfg, tp_rank)])


def _moe_plan(cfg: PretrainedConfig, i: int, tp_rank: int) -> list[tuple[str, Builder]]:
    tp = cfg.mapping.tp_size
    plan = [(trt_layer(i, "mlp.router.weight"), partial(_whole, hf_moe(cfg, i, "router"))),
            (trt_layer(i, "mlp.fc.weight"), partial(_expert_fc, cfg, i, tp_rank)),
            (trt_layer(i, "mlp.proj.weight"), partial(_expert_proj, cfg, i, tp_rank))]
    shared = cfg.moe.shared_expert_intermediate_size
    if shared:
        src = partial(hf_layer, i)
        plan += [
            (trt_layer(i, SHARED[0] + ".weight"),
             partial(_split, src("mlp.shared_expert.gate_proj.weight"), 0, shared, tp, tp_rank)),
            (trt_layer(i, SHARED[1] + ".weight"),
             partial(_split, src("mlp.shared_expert.up_proj.weight"), 0, shared, tp, tp_rank)),
            (trt_layer(i, SHARED[2] + ".weight"),
             partial(_split, src("mlp.shared_expert.down_proj.weight"), 1, shared, tp, tp_rank)),
            (trt_layer(i, "mlp.shared_expert_gate.weight"), partial(_whole, src("mlp.shared_expert_gate.weight"))),
        ]
    return plan


def rank_plan(cfg: PretrainedConfig, rank: int) -> list[tuple[str, Builder]]:
    """(TensorRT-LLM name, builder) for every tensor of rank `rank`'s checkpoint file."""
    tp = cfg.mapping.tp_size
    tp_rank, pp_rank = cfg.mapping.tp_rank(rank), cfg.mapping.pp_rank(rank)
    q_out, inter = cfg.num_attention_heads * cfg.head_size, cfg.intermediate_size
    plan: list[tuple[str, Builder]] = []

    if pp_rank == 0:
        plan.append(("transformer.vocab_embedding.weight", partial(_vocab, cfg, HF_EMBED, tp_rank)))

    for i in cfg.layers_of(pp_rank):
        plan += [(trt_layer(i, kiln + ".weight"), partial(_whole, hf_layer(i, hf + ".weight")))
                 for kiln, hf in norms(cfg)]
        plan.append((trt_layer(i, "attention.qkv.weight"), partial(_qkv, cfg, i, tp_rank, "weight")))
        if cfg.attn_bias:
            plan.append((trt_layer(i, "attention.qkv.bias"), partial(_qkv, cfg, i, tp_rank, "bias")))
        if cfg.qk_layernorm:
            plan += [(trt_layer(i, f"attention.{x}_layernorm.weight"), partial(_qk_norm, cfg, i, tp_rank, x))
                     for x in "qk"]
        plan.append((trt_layer(i, "attention.dense.weight"),
                     partial(_split, hf_layer(i, "self_attn.o_proj.weight"), 1, q_out, tp, tp_rank)))
        if cfg.is_moe_layer(i):
            plan += _moe_plan(cfg, i, tp_rank)
            continue
        plan += [
            # TensorRT-LLM's "fc" is the activated branch (HF gate_proj) and its "gate" the
            # multiplier (HF up_proj) - the names are swapped relative to HF's on purpose.
            (trt_layer(i, "mlp.fc.weight"),
             partial(_split, hf_layer(i, "mlp.gate_proj.weight"), 0, inter, tp, tp_rank)),
            (trt_layer(i, "mlp.gate.weight"),
             partial(_split, hf_layer(i, "mlp.up_proj.weight"), 0, inter, tp, tp_rank)),
            (trt_layer(i, "mlp.proj.weight"),
             partial(_split, hf_layer(i, "mlp.down_proj.weight"), 1, inter, tp, tp_rank)),
        ]

    if pp_rank == cfg.mapping.pp_size - 1:
        plan.append(("transformer.ln_f.weight", partial(_whole, HF_NORM)))
        # lm_head is always written, even when tied: the engine then needs no tying logic.
        head = HF_EMBED if cfg.tie_word_embeddings else HF_LM_HEAD
        plan.append(("lm_head.weight", partial(_vocab, cfg, head, tp_rank)))
    return plan


# ---------------------------------------------------------------------------------------------
# splitting a whole (tp 1) checkpoint's tensors, quantized ones included


def _rows(t: torch.Tensor, ranges: list[tuple[int, int]], out: int) -> torch.Tensor:
    """Output rows [a, b) of each range, of a tensor holding `out` rows in t.shape[0] (a packed int4
    weight holds two per row)."""
    per = t.shape[0] / out
    return torch.cat([t[int(a * per):int(b * per)] for a, b in ranges])


def shard_tensor(cfg: PretrainedConfig, name: str, t: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """Tensor `name` of the whole checkpoint (tp 1, any quant_algo) -> tp rank `tp_rank`'s part,
    laid out as rank_plan lays out plain tensors. Per-tensor scales (one value) are replicated;
    per-channel and per-group scales, zero points (shaped as those), packed int4 rows and pre-quant
    scales split with the dimension they belong to; a column-parallel linear's act-order input_index
    stays whole (its input is)."""
    tp = cfg.mapping.tp_size
    if tp == 1:
        return t
    if name in ("transformer.vocab_embedding.weight", "lm_head.weight"):
        part = cfg.vocab_size_padded // tp
        rows = t[tp_rank * part:(tp_rank + 1) * part]
        return torch.cat([rows, rows.new_zeros((part - rows.shape[0], *t.shape[1:]))]) if rows.shape[0] < part else rows
    index, _, rest = name.partition(".layers.")[2].partition(".")
    linear, _, suffix = rest.rpartition(".")
    if linear in ("attention.q_layernorm", "attention.k_layernorm") and cfg.qk_layernorm_scope == "projection":
        a, b = _projection_rows(cfg, linear[len("attention.")], tp_rank)
        return t[a:b]
    if t.numel() == 1 or linear not in COLUMN_PARALLEL + ROW_PARALLEL:
        return t  # norms, routers, KV cache scales, per-tensor weight/activation scales
    layer = int(index)
    out, inp = linear_shapes(cfg, layer)[linear]
    experts = cfg.is_moe_layer(layer) and linear in EXPERT_LINEARS
    if experts and suffix != "prequant_scaling_factor":  # [experts, ...]: the rank's experts, then per expert
        held = expert_range(cfg, tp_rank)
        return torch.stack([t[e] if t[e].numel() == 1 else _shard_linear(cfg, linear, suffix, t[e], tp_rank, layer,
                                                                          out, inp) for e in held])
    return _shard_linear(cfg, linear, suffix, t, tp_rank, layer, out, inp)


def _shard_linear(cfg, linear, suffix, t, tp_rank, layer, out, inp) -> torch.Tensor:
    if linear in COLUMN_PARALLEL:
        if suffix in ("prequant_scaling_factor", "input_index"):  # scales or orders the shared input
            return t
        return _rows(t, output_ranges(cfg, linear, tp_rank, layer), out).contiguous()
    # Row-parallel: the input dimension splits; a per-channel scale of the outputs is whole.
    if suffix == "input_index":
        raise ConfigError(f"{linear}.input_index (act-order) of layer {layer}: a row-parallel linear's gathered "
                          f"input does not split over tensor-parallel ranks; expected tp_size 1")
    parts = input_split(cfg, linear, layer)
    if suffix == "prequant_scaling_factor":
        dim, size = 0, inp
    elif t.dim() == 2:  # the weight [out, in] (int4: [out / 2, in]) or group scales [out, in / g]
        dim, size = 1, t.shape[1]
    else:
        return t
    part = size // parts
    return t.narrow(dim, (tp_rank % parts) * part, part).contiguous()
