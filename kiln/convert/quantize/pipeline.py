"""From a HF model dir to a quantized checkpoint's tensors and its accuracy report."""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from kiln.config import ConfigError, Mapping, PretrainedConfig, QuantConfig, torch_dtype
from kiln.convert.quantize.calib import default_dataset, make_split, read_texts
from kiln.convert.quantize.formats import (AWQ_ALGORITHMS, DEFAULT_AWQ_ALGORITHM, FORMATS, check_options,
                                          default_group_size, linear_prefixes, quant_config)

Dataset = str | Path | Sequence[str | Path] | None


@dataclass
class QuantOptions:
    qformat: str | None = None
    kv_cache_dtype: str | None = None
    group_size: int | None = None  # None: formats.default_group_size (int4 formats only)
    calib_dataset: Dataset = None
    calib_size: int = 512
    calib_max_seq_len: int = 512
    eval_dataset: Dataset = None
    eval_size: int = 64  # evaluation windows; 0: all of them
    awq_algorithm: str = DEFAULT_AWQ_ALGORITHM  # int4_awq only: lite, clip or full (formats.py)
    smoothquant_alpha: float | None = None  # int8_sq only: SmoothQuant's alpha (None: ModelOpt's 1.0)
    default_calibration: bool = False  # no dataset given: calib.default_texts (TensorRT-LLM's is a download)

    @property
    def enabled(self) -> bool:
        return self.qformat is not None or self.kv_cache_dtype is not None

    @property
    def calibrated(self) -> bool:
        # KV cache scales come from the K/V values seen in calibration.
        return self.kv_cache_dtype is not None or FORMATS[self.qformat].calibrated


@dataclass
class Prepared:
    calib_texts: list[str] | None
    eval_texts: list[str] | None
    # No accuracy report: calibrated on the default text, not the user's, and no --eval_dataset.
    report: bool = True


def prepare(cfg: PretrainedConfig, opts: QuantOptions) -> tuple[PretrainedConfig, Prepared]:
    """Check the options and read the datasets: every bad input fails here, before any work."""
    if opts.group_size is None:
        group_wise = opts.qformat in FORMATS and FORMATS[opts.qformat].group_wise
        opts = dataclasses.replace(opts, group_size=default_group_size(cfg) if group_wise else QuantConfig.group_size)
    check_options(cfg, opts.qformat, opts.kv_cache_dtype, opts.group_size, opts.awq_algorithm)
    for name in ("calib_size", "calib_max_seq_len"):
        if getattr(opts, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(opts, name)}")
    default = opts.calibrated and opts.calib_dataset is None and opts.default_calibration
    if default:
        opts = dataclasses.replace(opts, calib_dataset=default_dataset())
    if opts.calibrated and opts.calib_dataset is None:
        what = opts.qformat or f"--kv_cache_dtype {opts.kv_cache_dtype}"
        raise ConfigError(f"{what} needs calibration data: pass --calib_dataset (a text or .jsonl file, "
                          f"or a directory of files)")
    texts = Prepared(
        calib_texts=read_texts(opts.calib_dataset) if opts.calib_dataset is not None else None,
        eval_texts=read_texts(opts.eval_dataset, "evaluation") if opts.eval_dataset is not None else None,
        report=not default or opts.eval_dataset is not None,
    )
    quantized = dataclasses.replace(cfg, quantization=quant_config(opts.qformat, opts.kv_cache_dtype,
                                                                   opts.group_size, opts.awq_algorithm))
    return quantized, texts


def _load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    # float32 whatever the weights' dtype: calibration and the report's reference in full precision.
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def quantize(cfg: PretrainedConfig, opts: QuantOptions, texts: Prepared, weights, model_dir: Path,
             log: Callable[[str], object] = lambda _: None) -> tuple[dict[str, torch.Tensor], dict | None]:
    """All tensors of the (unsharded) quantized checkpoint, and the accuracy report (None when
    there was no text to evaluate on)."""
    from kiln.convert.quantize import report as rep
    from kiln.convert.quantize.rtn import quantize_linear
    from kiln.convert.shard import rank_plan

    start = time.perf_counter()
    single = dataclasses.replace(cfg, mapping=Mapping())
    base = {name: build(weights) for name, build in rank_plan(single, 0)}
    dtype = torch_dtype(cfg.dtype)
    algo, group = cfg.quantization.quant_algo, cfg.quantization.group_size

    split = None
    if texts.calib_texts is not None or texts.eval_texts is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        split = make_split(tokenizer, texts.calib_texts, texts.eval_texts, opts.calib_size,
                           opts.calib_max_seq_len, opts.eval_size)
        if not texts.report:
            split.eval = []

    quant_model = ref_model = None
    if opts.calibrated:
        from kiln.convert.quantize.modelopt import quantize_and_export

        quant_model = _load_hf(model_dir)
        ref_model = copy.deepcopy(quant_model) if split.eval else None
        quantized = quantize_and_export(quant_model, cfg.architecture, opts.qformat, opts.kv_cache_dtype,
                                        group, split.calib, cfg.num_hidden_layers, cfg.dtype, log,
                                        opts.awq_algorithm, base, opts.smoothquant_alpha)
        method = f"ModelOpt {FORMATS[opts.qformat].modelopt_cfg if opts.qformat else 'KV cache'}"
        if opts.qformat == "int4_awq":
            method += f" ({AWQ_ALGORITHMS[opts.awq_algorithm]})"
    else:
        log(f"quantizing {opts.qformat} by round-to-nearest (no calibration)")
        quantized = {}
        for prefix in linear_prefixes(cfg):
            for suffix, t in quantize_linear(base[prefix + ".weight"], algo, group).items():
                quantized[f"{prefix}.{suffix}"] = t
        method = "round-to-nearest (no calibration)"

    replaced = {p + ".weight" for p in linear_prefixes(cfg)} if algo else set()
    tensors = {name: t.to(dtype, copy=True).contiguous() for name, t in base.items() if name not in replaced}
    tensors.update({name: t.contiguous() for name, t in quantized.items()})

    report = None
    if split is not None and split.eval:
        log(f"evaluating against the unquantized model on {len(split.eval)} window(s)")
        if quant_model is None:
            ref_model, quant_model = _load_hf(model_dir), _load_hf(model_dir)
            rep.load_dequantized(quant_model, tensors, algo, group, cfg.num_hidden_layers)
        from kiln.convert.quantize.modelopt import quiet

        with quiet():
            metrics = rep.compare(ref_model, quant_model, split.eval)
        q = cfg.quantization
        report = {
            "qformat": opts.qformat, "kv_cache_dtype": opts.kv_cache_dtype, "quant_algo": q.quant_algo,
            "kv_cache_quant_algo": q.kv_cache_quant_algo,
            "group_size": q.group_size if opts.qformat and FORMATS[opts.qformat].group_wise else None,
            "method": method, "calib_samples": len(split.calib),
            "calib_tokens": sum(len(w) for w in split.calib), "calib_max_seq_len": opts.calib_max_seq_len,
            "eval_source": split.eval_source, "eval_windows": len(split.eval),
            "compute_dtype": "float32", **metrics,
            "seconds": round(time.perf_counter() - start, 1),
        }
    return tensors, report


def rank_tensors(cfg: PretrainedConfig, tensors: dict[str, torch.Tensor], rank: int) -> dict:
    """The tensors rank `rank` holds: its pipeline stage's, split for its tensor-parallel rank."""
    from kiln.convert.shard import shard_tensor

    pp_rank, tp_rank = cfg.mapping.pp_rank(rank), cfg.mapping.tp_rank(rank)
    layers = cfg.layers_of(pp_rank)
    last = pp_rank == cfg.mapping.pp_size - 1

    def held(name: str) -> bool:
        if name.startswith("transformer.layers."):
            return int(name.split(".")[2]) in layers
        if name == "transformer.vocab_embedding.weight":
            return pp_rank == 0
        return last  # ln_f, lm_head

    return {name: shard_tensor(cfg, name, t, tp_rank) for name, t in tensors.items() if held(name)}
