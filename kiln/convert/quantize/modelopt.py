"""The calibrated formats through NVIDIA ModelOpt: quantize a HF model, export it as a
TensorRT-LLM checkpoint, and take its quantized tensors.

ModelOpt's own config.json is not used: ours (from the HF config) is complete where ModelOpt's is
not (rotary_scaling, qk_layernorm, tokenizer files), so only the quantized linears, their scales
and the KV cache scales are taken from its export.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch

from kiln.config import ConfigError
from kiln.convert.quantize.formats import (AWQ_ALGORITHMS, DEFAULT_AWQ_ALGORITHM, FORMATS, LINEARS,
                                          writes_pre_quant_scale)
from kiln.convert.quantize.gptq import gptq_algorithm

# What this converter can take from a ModelOpt export, by the quant_algo ModelOpt reports.
SUPPORTED_MODELOPT_ALGOS = {f.modelopt_algo for f in FORMATS.values()} | {None}
SUPPORTED_MODELOPT_KV = {"FP8", "INT8", None}
SCALE_SUFFIXES = ("weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor",
                  "prequant_scaling_factor")
KV_SCALES = ("kv_cache_scaling_factor", "k_cache_scaling_factor", "v_cache_scaling_factor")

KV_QUANT_CFG = {
    "fp8": {"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}},
    "int8": {"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": 8, "axis": None}},
}


@contextlib.contextmanager
def quiet():
    """ModelOpt prints progress and warnings of its own; keep stdout for the report and summary."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _set_block_size(quant_cfg: list, group_size: int) -> None:
    for entry in quant_cfg:
        cfgs = entry.get("cfg")
        for c in cfgs if isinstance(cfgs, list) else [cfgs] if cfgs else []:
            if c.get("block_sizes"):
                c["block_sizes"] = {**c["block_sizes"], -1: group_size}


def modelopt_config(qformat: str | None, kv_cache_dtype: str | None, group_size: int,
                    awq_algorithm: str = DEFAULT_AWQ_ALGORITHM, smoothquant_alpha: float | None = None) -> dict:
    """smoothquant_alpha: int8_sq's migration strength (None: ModelOpt's default, 1.0); TensorRT-LLM's
    convert_checkpoint --smoothquant passes it."""
    import modelopt.torch.quantization as mtq

    if qformat is None:  # KV cache only: every weight and activation left alone
        config = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        config = copy.deepcopy(getattr(mtq, FORMATS[qformat].modelopt_cfg))
        _set_block_size(config["quant_cfg"], group_size)
        if qformat == "int4_gptq":
            config["algorithm"] = gptq_algorithm(group_size)
        elif qformat == "int4_awq":  # w4a8_awq keeps its preset's awq_lite
            config["algorithm"] = {"method": AWQ_ALGORITHMS[awq_algorithm]}
        elif qformat == "int8_sq" and smoothquant_alpha is not None:
            config["algorithm"] = {"method": "smoothquant", "alpha": smoothquant_alpha}
    if kv_cache_dtype is not None:
        config["quant_cfg"] = list(config["quant_cfg"]) + [copy.deepcopy(KV_QUANT_CFG[kv_cache_dtype])]
    return config


def quantize_model(model, qformat: str | None, kv_cache_dtype: str | None, group_size: int,
                   calib: list[torch.Tensor], batch_size: int = 8,
                   awq_algorithm: str = DEFAULT_AWQ_ALGORITHM, smoothquant_alpha: float | None = None) -> None:
    """Quantize `model` in place (fake-quant modules), calibrating on `calib` token windows."""
    import modelopt.torch.quantization as mtq

    from kiln.convert.quantize.calib import batches

    calib_batches = batches(calib, batch_size)

    def forward_loop(m):
        for batch in calib_batches:
            m(input_ids=batch)

    with quiet(), torch.no_grad():
        mtq.quantize(model, modelopt_config(qformat, kv_cache_dtype, group_size, awq_algorithm, smoothquant_alpha),
                     forward_loop)


def export(model, architecture: str, dtype: str, export_dir: Path) -> None:
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    decoder = "qwen" if architecture.startswith("Qwen") else "llama"
    # ModelOpt exports unquantized tensors in fp16/bf16 only; which one matters for the
    # pre-quant scales alone, which are cast to the checkpoint's dtype afterwards.
    export_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    with quiet(), torch.inference_mode():
        export_tensorrt_llm_checkpoint(model, decoder, export_dtype, export_dir=export_dir,
                                       inference_tensor_parallel=1)


def read_export(export_dir: Path, expected_algo: str | None, num_layers: int,
                dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """The quantization section and quantized tensors of a ModelOpt TensorRT-LLM export.

    Only linears' weights and scales and the KV cache scales are returned; everything else in
    the export is ignored.
    """
    from safetensors.torch import load_file

    path = export_dir / "config.json"
    quant = (json.loads(path.read_text()).get("quantization") or {})
    algo, kv = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    if algo not in SUPPORTED_MODELOPT_ALGOS:
        raise ConfigError(f"{path}: ModelOpt quant_algo {algo!r} is not supported; expected one of "
                          f"{', '.join(sorted(a for a in SUPPORTED_MODELOPT_ALGOS if a))}")
    if kv not in SUPPORTED_MODELOPT_KV:
        raise ConfigError(f"{path}: ModelOpt kv_cache_quant_algo {kv!r} is not supported; expected "
                          f"FP8 or INT8")
    if algo != expected_algo:
        raise ConfigError(f"{path}: ModelOpt exported quant_algo {algo!r}, expected {expected_algo!r}")
    ranks = sorted(export_dir.glob("rank*.safetensors"))
    if len(ranks) != 1:
        raise ConfigError(f"{export_dir}: expected one rank file from ModelOpt, found {len(ranks)}")
    exported = load_file(ranks[0])

    wanted = []
    for i in range(num_layers):
        layer = f"transformer.layers.{i}."
        wanted += [layer + f"attention.{s}" for s in KV_SCALES] if kv else []
        linears = LINEARS
        if layer + "mlp.router.weight" in exported:  # a MoE layer: experts stacked, a shared expert fused
            linears = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.proj") + tuple(
                n for n in ("mlp.shared_expert.fc", "mlp.shared_expert.proj") if layer + n + ".weight" in exported)
        if algo:
            wanted += [layer + f"{p}.{s}" for p in linears for s in ("weight",) + SCALE_SUFFIXES]
    tensors = {}
    for name in wanted:
        if name in exported:
            t = exported[name]
            tensors[name] = t.to(dtype) if name.endswith("prequant_scaling_factor") else t
    missing = [n for n in wanted if n.endswith((".weight", ".kv_cache_scaling_factor"))
               and n not in tensors]
    if missing:
        raise ConfigError(f"{ranks[0]}: ModelOpt export lacks {missing[0]}")
    return quant, tensors


KV_MAX = {"fp8": 448.0, "int8": 127.0}  # the 8-bit grid's largest value: amax = scale * KV_MAX


def match_checkpoint(model, tensors: dict[str, torch.Tensor], quant_algo: str | None, group_size: int,
                     num_layers: int, kv_cache_dtype: str | None) -> None:
    """Make ModelOpt's fake-quant model compute what the checkpoint holds, so that the accuracy
    report is the checkpoint's own. Export states three things differently from the quantizers:
    pre-quant scales rounded to 16 bits, one KV-cache scale for K and V (FP8 ones clamped to >= 1),
    and weights one step off in a few elements (it divides by the scale in 16-bit arithmetic).
    The weights become the checkpoint's, dequantized (the weight quantizers map them onto
    themselves); pre-quant scales go to the input quantizers; KV scales to the K/V quantizers."""
    from kiln.convert.quantize.report import hf_linears, is_moe_layer, load_dequantized

    pqs = {k: v for k, v in tensors.items() if k.endswith(".prequant_scaling_factor")}
    with torch.inference_mode():  # export left inference tensors behind
        if quant_algo:  # unfolded: the input quantizers apply the pre-quant scales
            load_dequantized(model, {k: v for k, v in tensors.items() if k not in pqs}, quant_algo,
                             group_size, num_layers)
        for i in range(num_layers):
            layer, prefix = model.model.layers[i], f"transformer.layers.{i}."
            for name, modules in hf_linears(layer, is_moe_layer(layer)).items():
                if prefix + name + ".prequant_scaling_factor" in pqs:
                    for module in modules:
                        module.input_quantizer.pre_quant_scale = pqs[prefix + name + ".prequant_scaling_factor"].float()
            if kv_cache_dtype:
                amax = tensors[prefix + "attention.kv_cache_scaling_factor"].float() * KV_MAX[kv_cache_dtype]
                for q in (layer.self_attn.k_bmm_quantizer, layer.self_attn.v_bmm_quantizer):
                    q.amax = amax.reshape(q.amax.shape)


def _closer(candidate: torch.Tensor, other: torch.Tensor, reference: torch.Tensor) -> bool:
    return (candidate - reference).abs().mean() <= (other - reference).abs().mean()


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = t.view(torch.uint8).chunk(2)  # on the bits: fp8 ops are not everywhere
    return a.view(t.dtype), b.view(t.dtype)


def adopt_moe(tensors: dict[str, torch.Tensor], base: dict[str, torch.Tensor], num_layers: int) -> None:
    """ModelOpt's export of a MoE layer in Kiln's layout (kiln/layout.py): each expert's fc
    as [up; gate] and the shared expert's fused gate and up split into fc (gate_proj) and gate
    (up_proj). Which half ModelOpt wrote first is read off the unquantized weights (`base`, Kiln's
    own layout), not assumed: its order differs between its model paths and versions."""
    def deq(name, w):
        return w.float() * tensors[name + ".weights_scaling_factor"].float().reshape(-1, *[1] * (w.dim() - 1))

    for i in range(num_layers):
        p = f"transformer.layers.{i}."
        if p + "mlp.router.weight" not in base or p + "mlp.fc.weight" not in tensors:
            continue
        fc, ref = tensors[p + "mlp.fc.weight"], base[p + "mlp.fc.weight"].float()
        swapped = fc.view(torch.uint8).roll(fc.shape[1] // 2, dims=1).view(fc.dtype)  # halves swapped, on the bits
        if not _closer(deq(p + "mlp.fc", fc), deq(p + "mlp.fc", swapped), ref):
            tensors[p + "mlp.fc.weight"] = swapped
        fused, gate = p + "mlp.shared_expert.fc", p + "mlp.shared_expert.gate"
        if fused + ".weight" in tensors and tensors[fused + ".weight"].shape[0] == 2 * base[fused + ".weight"].shape[0]:
            first, second = _halves(tensors[fused + ".weight"])
            if not _closer(deq(fused, first), deq(fused, second), base[fused + ".weight"].float()):
                first, second = second, first
            tensors[fused + ".weight"], tensors[gate + ".weight"] = first.contiguous(), second.contiguous()
            for suffix in SCALE_SUFFIXES:
                if f"{fused}.{suffix}" in tensors:
                    tensors[f"{gate}.{suffix}"] = tensors[f"{fused}.{suffix}"].clone()


def quantize_and_export(model, architecture: str, qformat: str | None, kv_cache_dtype: str | None,
                        group_size: int, calib: list[torch.Tensor], num_layers: int, dtype: str,
                        log: Callable[[str], object] = lambda _: None,
                        awq_algorithm: str = DEFAULT_AWQ_ALGORITHM,
                        base: dict[str, torch.Tensor] | None = None,
                        smoothquant_alpha: float | None = None) -> dict[str, torch.Tensor]:
    """base: the unquantized checkpoint's tensors, in Kiln's layout (a mixture of experts needs them)."""
    from kiln.config import torch_dtype

    what = " + ".join(x for x in (qformat, kv_cache_dtype and f"{kv_cache_dtype} KV cache") if x)
    tokens = sum(len(w) for w in calib)
    if qformat == "int4_awq":
        what += f" ({AWQ_ALGORITHMS[awq_algorithm]})"
    if qformat == "int8_sq" and smoothquant_alpha is not None:
        what += f" (alpha {smoothquant_alpha:g})"
    log(f"calibrating {what} with ModelOpt on {len(calib)} sample(s), {tokens:,} tokens")
    quantize_model(model, qformat, kv_cache_dtype, group_size, calib, awq_algorithm=awq_algorithm,
                   smoothquant_alpha=smoothquant_alpha)
    expected = FORMATS[qformat].modelopt_algo if qformat else None
    with tempfile.TemporaryDirectory(prefix="kiln-modelopt-") as tmp:
        export(model, architecture, dtype, Path(tmp))
        _, tensors = read_export(Path(tmp), expected, num_layers, torch_dtype(dtype))
    if base is not None:
        adopt_moe(tensors, base, num_layers)
    if qformat and not writes_pre_quant_scale(qformat, awq_algorithm):
        # GPTQ, awq_clip and plain int4 go out under AWQ's name; a pre-quant scale there could
        # only be ones. (ModelOpt's own config says pre_quant_scale: true even for awq_clip, whose
        # export has none; ours says false, see formats.writes_pre_quant_scale.)
        tensors = {k: v for k, v in tensors.items() if not k.endswith("prequant_scaling_factor")}
    elif qformat:  # the config will say pre_quant_scale: true, so every linear must have one
        missing = [p for p in (f"transformer.layers.{i}.{n}" for i in range(num_layers) for n in LINEARS)
                   if f"{p}.prequant_scaling_factor" not in tensors]
        if missing:
            raise ConfigError(f"ModelOpt's {qformat} export lacks {missing[0]}.prequant_scaling_factor")
    match_checkpoint(model, tensors, FORMATS[qformat].quant_algo if qformat else None, group_size, num_layers,
                     kv_cache_dtype)
    return tensors
