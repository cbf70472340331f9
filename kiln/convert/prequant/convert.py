"""A pre-quantized HF checkpoint's tensors as Kiln's (whole, tp 1) quantized checkpoint, read once.

Everything that is not a quantized linear (embeddings, norms, biases, lm_head) comes from the
converter's own plan; each quantized linear's HF parts (q/k/v; o; gate; up; down) are read by the
format's reader and laid out by mapping.py. An act-order down_proj's input order moves onto the rows
of gate_proj and up_proj, which produce its input, so it needs no gather (and splits over tp ranks
at group boundaries as any down_proj does).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from kiln.config import ConfigError, Mapping, PretrainedConfig, QuantConfig, torch_dtype
from kiln.convert.prequant import mapping
from kiln.convert.prequant.reader import Reader
from kiln.convert.prequant.linears import FloatLinear, FP8Linear

# Kiln linear -> its HF modules, in the order their rows are fused
HF_PARTS = {"attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "attention.dense": ("self_attn.o_proj",), "mlp.fc": ("mlp.gate_proj",), "mlp.gate": ("mlp.up_proj",),
            "mlp.proj": ("mlp.down_proj",)}
REQUANTIZE = ("int4_wo", "int8_wo")  # round-to-nearest from the dequantized weights; no calibration


@dataclasses.dataclass
class Outcome:
    cfg: PretrainedConfig
    tensors: dict[str, torch.Tensor]
    note: str  # what was done, for the summary line


def quant_algo(reader: Reader) -> str:
    if reader.bits == 4:
        return {"gptq": "W4A16_GPTQ", "awq": "W4A16_AWQ"}.get(reader.method, "W4A16")
    if reader.bits == 8:
        return "W8A16"
    return "FP8_PER_CHANNEL_PER_TOKEN" if reader.dynamic_activations else "FP8"


def check(cfg: PretrainedConfig, reader: Reader, qformat: str | None, fused: dict) -> bool:
    """Refuse what cannot be converted, before any tensor is read; True where the format maps exactly."""
    what = reader.describe()
    if cfg.moe.num_experts:
        raise ConfigError(f"{what} checkpoints of a mixture of experts ({cfg.architecture}) are not supported yet; "
                          f"convert the unquantized model with --qformat")
    if fused:
        raise ConfigError(f"{what} checkpoints of {cfg.architecture} (fused qkv_proj/gate_up_proj) are not supported; "
                          f"expected separate q/k/v and gate/up projections")
    exact = reader.exact and not (reader.bits == 8 and reader.group_size)
    if exact and qformat:
        raise ConfigError(f"the model is already quantized ({what}), and Kiln runs it as it is; --qformat {qformat} "
                          f"would quantize it a second time: drop --qformat")
    if not exact and qformat not in (None, *REQUANTIZE):
        raise ConfigError(f"--qformat {qformat} calibrates the unquantized model, which this checkpoint ({what}) is "
                          f"not; expected one of {', '.join(REQUANTIZE)} (round-to-nearest from its dequantized weights)")
    return exact


def convert(cfg: PretrainedConfig, reader: Reader, weights, qformat: str | None = None,
            log: Callable[[str], object] = lambda _: None) -> Outcome:
    from kiln.convert.quantize.formats import rank_inputs
    from kiln.convert.shard import fused_tensors, rank_plan, trt_layer

    exact = check(cfg, reader, qformat, fused_tensors(cfg))
    single = dataclasses.replace(cfg, mapping=Mapping())
    dtype = torch_dtype(cfg.dtype)
    linear_names = {trt_layer(i, f"{k}.weight") for i in range(cfg.num_hidden_layers) for k in HF_PARTS}
    tensors = {name: build(weights).to(dtype, copy=True).contiguous() for name, build in rank_plan(single, 0)
               if name not in linear_names}
    algo = quant_algo(reader) if exact else None
    group = (mapping.kiln_group_size(reader.group_size, list(rank_inputs(cfg).values()), reader.describe())
             if algo and algo.startswith("W4") else QuantConfig.group_size)
    excluded = ["lm_head"]
    for i in range(cfg.num_hidden_layers):
        plain = {k: [reader.read(weights, f"model.layers.{i}.{hf}") for hf in parts] for k, parts in HF_PARTS.items()}
        down = plain["mlp.proj"][0]
        if exact and down is not None and not isinstance(down, (FP8Linear, FloatLinear)):
            down, order = mapping.sort_by_group(down)
            if order is not None:
                plain["mlp.proj"] = [down]
                plain["mlp.fc"] = [_rows(p, order, weights, f"model.layers.{i}.mlp.gate_proj") for p in plain["mlp.fc"]]
                plain["mlp.gate"] = [_rows(p, order, weights, f"model.layers.{i}.mlp.up_proj") for p in plain["mlp.gate"]]
        for kiln, parts in plain.items():
            name = trt_layer(i, kiln)
            if all(p is None for p in parts):  # stored unquantized (the format's ignore list)
                tensors[f"{name}.weight"] = _float(weights, i, kiln).to(dtype)
                excluded.append(name)
                continue
            if any(p is None for p in parts):
                raise ConfigError(f"{name}: the checkpoint quantizes some of {', '.join(HF_PARTS[kiln])} and not the "
                                  f"others; Kiln runs them as one GEMM")
            if not exact:
                parts = [FloatLinear(p.dequantize()) for p in parts]
            out = mapping.kiln_tensors(parts, group, not reader.symmetric, reader.dynamic_activations, name)
            if "input_index" in out and kiln == "attention.dense" and cfg.mapping.tp_size > 1:
                raise ConfigError(f"{name}: act-order (desc_act) o_proj weights cannot be split over --tp_size "
                                  f"{cfg.mapping.tp_size} ranks exactly (its quantization groups mix the ranks' "
                                  f"heads); convert with --tp_size 1 (--pp_size splits layers instead)")
            if not exact:
                out["weight"] = out["weight"].to(dtype)
            tensors.update({f"{name}.{k}": v for k, v in out.items()})
    quant = QuantConfig(quant_algo=algo, group_size=group, has_zero_point=bool(algo) and not reader.symmetric,
                        exclude_modules=excluded if algo else None)
    cfg = dataclasses.replace(cfg, quantization=quant)
    if exact:
        return Outcome(cfg, tensors, f"{reader.describe()} read as {algo}"
                       f"{f' group {group}' if algo.startswith('W4') else ''} without re-quantizing")
    note = f"{reader.describe()} has no exact Kiln kernel: dequantized to {cfg.dtype}"
    if qformat is None:
        return Outcome(cfg, tensors, note)
    return _requantize(cfg, tensors, qformat, note, log)


def _rows(lin, order, weights, prefix):
    if lin is None:
        raise ConfigError(f"{prefix} is unquantized while the down_proj it feeds is act-order quantized; expected "
                          f"both quantized")
    return mapping.permute_rows(lin, order)


def _float(weights, i: int, kiln: str) -> torch.Tensor:
    return torch.cat([weights.read(f"model.layers.{i}.{hf}.weight") for hf in HF_PARTS[kiln]])


def _requantize(cfg, tensors, qformat, note, log) -> Outcome:
    from kiln.convert.quantize.formats import check_options, default_group_size, linear_prefixes, quant_config
    from kiln.convert.quantize.rtn import quantize_linear

    group = default_group_size(cfg) if qformat == "int4_wo" else QuantConfig.group_size
    check_options(cfg, qformat, None, group)
    cfg = dataclasses.replace(cfg, quantization=quant_config(qformat, None, group))
    log(f"quantizing {qformat} by round-to-nearest from the dequantized weights")
    for prefix in linear_prefixes(cfg):
        w = tensors.pop(f"{prefix}.weight")
        tensors.update({f"{prefix}.{k}": v for k, v in quantize_linear(w, cfg.quantization.quant_algo, group).items()})
    return Outcome(cfg, tensors, f"{note}, then quantized {qformat} (round-to-nearest) as --qformat asked")
