"""A pre-quantized HF checkpoint's tensors as Kiln's (whole, tp 1) quantized checkpoint, read once.

Each quantized linear's HF parts (q/k/v; o; gate; up; down; a mixture's experts, stacked) are read by
the format's reader and laid out by mapping.py; everything else (embeddings, norms, biases, routers,
lm_head, and linears the format left unquantized) comes from the converter's own plan. Split over tp
ranks, an act-order down_proj's input order moves onto the rows of the gate_proj and up_proj that
produce its input, so that each rank holds whole groups (its input does not split by rank otherwise);
LoRA adapters of the MLP, in the HF order, are then refused (quantization.mlp_channels_by_group).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from kiln.config import ConfigError, Mapping, PretrainedConfig, QuantConfig, torch_dtype
from kiln.convert.hf import CheckpointError
from kiln.convert.prequant import mapping
from kiln.convert.prequant.linears import FloatLinear, IntLinear
from kiln.convert.prequant.reader import Reader

ATTENTION = {"attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "attention.dense": ("self_attn.o_proj",)}
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
    if fused:
        raise ConfigError(f"{what} checkpoints of {cfg.architecture} (fused qkv_proj/gate_up_proj) are not supported; "
                          f"expected separate q/k/v and gate/up projections")
    exact = reader.exact and not (reader.bits == 8 and reader.group_size)
    if exact and cfg.moe.num_experts and (not reader.symmetric or reader.dynamic_activations):
        raise ConfigError(f"{what} checkpoints of a mixture of experts ({cfg.architecture}) are not supported: Kiln's "
                          f"MoE kernels take no {'zero points' if not reader.symmetric else 'per-token FP8'}")
    if exact and qformat:
        raise ConfigError(f"the model is already quantized ({what}), and Kiln runs it as it is; --qformat {qformat} "
                          f"would quantize it a second time: drop --qformat")
    if not exact and qformat not in (None, *REQUANTIZE):
        raise ConfigError(f"--qformat {qformat} calibrates the unquantized model, which this checkpoint ({what}) is "
                          f"not; expected one of {', '.join(REQUANTIZE)} (round-to-nearest from its dequantized weights)")
    return exact


def _mlps(cfg: PretrainedConfig, i: int) -> list[tuple[str, tuple[str, str, str]]]:
    """Layer i's gated MLPs as (kind, HF (gate, up, down) prefixes): "dense", "expert" (in expert order)
    or "shared"."""
    from kiln.convert.shard import hf_moe

    if not cfg.is_moe_layer(i):
        return [("dense", tuple(f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up", "down")))]
    out = [("expert", tuple(hf_moe(cfg, i, p, e).removesuffix(".weight") for p in ("gate", "up", "down")))
           for e in range(cfg.moe.num_experts)]
    if cfg.moe.shared_expert_intermediate_size:
        out.append(("shared", tuple(f"model.layers.{i}.mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down"))))
    return out


class _Layout:
    """Reads a checkpoint's linears and lays them out as Kiln's tensors (`tensors`), noting the ones the
    format left unquantized (`excluded`: the converter's plan reads those as floats)."""

    def __init__(self, cfg: PretrainedConfig, reader: Reader, weights, exact: bool, group: int):
        from kiln.convert.shard import source_shapes

        self.cfg, self.reader, self.weights, self.exact, self.group = cfg, reader, weights, exact, group
        self.shapes = source_shapes(cfg)  # each HF linear's [out, in], as config.json implies it
        self.tensors: dict[str, torch.Tensor] = {}
        self.excluded: list[str] = []
        self.folded = False  # an act-order down_proj's order moved onto its gate/up rows

    def layer(self, i: int) -> None:
        for kiln, parts in ATTENTION.items():
            self._write(f"transformer.layers.{i}.{kiln}", [self._read(f"model.layers.{i}.{p}") for p in parts])
        experts = []
        for kind, prefixes in _mlps(self.cfg, i):
            gate, up, down = self._mlp(*prefixes)
            if kind == "expert":
                experts.append(([up, gate], [down]))  # Kiln's expert fc: up rows, then gate rows
                continue
            names = ("mlp.fc", "mlp.gate", "mlp.proj") if kind == "dense" else (
                "mlp.shared_expert.fc", "mlp.shared_expert.gate", "mlp.shared_expert.proj")
            for name, lin in zip(names, (gate, up, down)):
                self._write(f"transformer.layers.{i}.{name}", [lin])
        if experts:
            for j, name in enumerate(("mlp.fc", "mlp.proj")):
                self._write_experts(f"transformer.layers.{i}.{name}", [e[j] for e in experts])

    def _read(self, prefix: str):
        """The plain form of HF linear `prefix` (None: stored unquantized), its shape checked against
        config.json's before anything is laid out."""
        lin, expected = self.reader.read(self.weights, prefix), self.shapes[f"{prefix}.weight"]
        if lin is None:  # read as a float by the converter's plan; fail here, before any work, if it is wrong
            self.weights.check({f"{prefix}.weight": expected})
            return None
        if lin.shape != expected:
            raise CheckpointError(f"{prefix}: its {self.reader.method} tensors stand for a {list(lin.shape)} weight, "
                                  f"expected {list(expected)} from config.json")
        return lin if self.exact else FloatLinear(lin.dequantize())

    def _mlp(self, gate: str, up: str, down: str):
        g, u, d = (self._read(p) for p in (gate, up, down))
        if isinstance(d, IntLinear) and self.cfg.mapping.tp_size > 1:  # on one rank: down_proj's input gather
            d, order = mapping.sort_by_group(d)
            self.folded |= order is not None
            if order is not None:
                if g is None or u is None:
                    raise ConfigError(f"{gate}/{up}: unquantized while the {down} they feed is act-order quantized; "
                                      f"expected all three quantized")
                g, u = mapping.permute_rows(g, order), mapping.permute_rows(u, order)
        return g, u, d

    def _tensors(self, name: str, parts: list) -> dict[str, torch.Tensor] | None:
        if all(p is None for p in parts):  # stored unquantized (the format's ignore list)
            return None
        if any(p is None for p in parts):
            raise ConfigError(f"{name}: the checkpoint quantizes some of the HF linears it fuses and not the others; "
                              f"Kiln runs them as one GEMM")
        out = mapping.kiln_tensors(parts, self.group, not self.reader.symmetric, self.reader.dynamic_activations, name)
        if "input_index" in out and name.endswith("attention.dense") and self.cfg.mapping.tp_size > 1:
            raise ConfigError(f"{name}: act-order (desc_act) o_proj weights cannot be split over --tp_size "
                              f"{self.cfg.mapping.tp_size} ranks exactly (its quantization groups mix the ranks' "
                              f"heads); convert with --tp_size 1 (--pp_size splits layers instead)")
        if not self.exact:
            out["weight"] = out["weight"].to(torch_dtype(self.cfg.dtype))
        return out

    def _write(self, name: str, parts: list) -> None:
        out = self._tensors(name, parts)
        if out is None:
            self.excluded.append(name)
        else:
            self.tensors.update({f"{name}.{k}": v for k, v in out.items()})

    def _write_experts(self, name: str, experts: list[list]) -> None:
        each = [self._tensors(f"{name} (expert {e})", parts) for e, parts in enumerate(experts)]
        if all(e is None for e in each):
            self.excluded.append(name)
            return
        if any(e is None for e in each):
            raise ConfigError(f"{name}: some experts are quantized and some not; expected all or none")
        if "input_index" in each[0]:
            raise ConfigError(f"{name}: act-order (desc_act) experts are not supported; Kiln's MoE kernels take "
                              f"each expert's inputs in order")
        for key in each[0]:
            ts = [e[key] for e in each]
            if key == "activation_scaling_factor":  # one per layer, shared by the experts (ModelOpt's export)
                self.tensors[f"{name}.{key}"] = torch.stack(ts).amax(0)
                continue
            if key == "weights_scaling_factor" and len({t.numel() for t in ts}) > 1:  # FP8: per row where any is
                rows = max(t.numel() for t in ts)
                ts = [t.expand(rows) for t in ts]
            self.tensors[f"{name}.{key}"] = torch.stack(ts).contiguous()


def convert(cfg: PretrainedConfig, reader: Reader, weights, qformat: str | None = None,
            log: Callable[[str], object] = lambda _: None) -> Outcome:
    from kiln.convert.quantize.formats import rank_inputs
    from kiln.convert.shard import fused_tensors, rank_plan

    exact = check(cfg, reader, qformat, fused_tensors(cfg))
    algo = quant_algo(reader) if exact else None
    group = (mapping.kiln_group_size(reader.group_size, list(rank_inputs(cfg).values()), reader.describe())
             if algo and algo.startswith("W4") else QuantConfig.group_size)
    layout = _Layout(cfg, reader, weights, exact, group)
    linears = {f"model.layers.{i}.{p}.weight" for i in range(cfg.num_hidden_layers) for parts in ATTENTION.values()
               for p in parts} | {f"{p}.weight" for i in range(cfg.num_hidden_layers) for _, mlp in _mlps(cfg, i)
                                  for p in mlp}
    weights.check({n: s for n, s in layout.shapes.items() if n not in linears})  # the rest: before any work
    for i in range(cfg.num_hidden_layers):
        layout.layer(i)
    dtype = torch_dtype(cfg.dtype)
    tensors = {name: build(weights).to(dtype, copy=True).contiguous()
               for name, build in rank_plan(dataclasses.replace(cfg, mapping=Mapping()), 0)
               if name not in layout.tensors}
    tensors.update(layout.tensors)
    quant = QuantConfig(quant_algo=algo, group_size=group, has_zero_point=bool(algo) and not reader.symmetric,
                        exclude_modules=["lm_head", *layout.excluded] if algo else None,
                        mlp_channels_by_group=layout.folded)
    cfg = dataclasses.replace(cfg, quantization=quant)
    if exact:
        return Outcome(cfg, tensors, f"{reader.describe()} read as {algo}"
                       f"{f' group {group}' if algo.startswith('W4') else ''} without re-quantizing")
    note = f"{reader.describe()} has no exact Kiln kernel: dequantized to {cfg.dtype}"
    if qformat is None:
        return Outcome(cfg, tensors, note)
    return _requantize(cfg, tensors, qformat, note, log)


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
