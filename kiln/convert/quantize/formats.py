"""The quantization formats `convert_checkpoint` writes, named as TensorRT-LLM names them."""
from __future__ import annotations

from dataclasses import dataclass

from kiln.config import ConfigError, PretrainedConfig, QuantConfig
from kiln.layout import all_linear_shapes, input_split, layer_kinds, linear_shapes, output_ranges


@dataclass(frozen=True)
class Format:
    quant_algo: str
    group_wise: bool  # int4 with one scale per `group_size` inputs
    calibrated: bool  # needs activations (AWQ, GPTQ, SmoothQuant, FP8 activation scales)
    pre_quant_scale: bool  # writes prequant_scaling_factor (the GEMM input is x * pqs)
    modelopt_cfg: str  # the ModelOpt preset the format is made with
    modelopt_algo: str  # the quant_algo ModelOpt's export reports for it


FORMATS = {
    "fp8": Format("FP8", False, True, False, "FP8_DEFAULT_CFG", "FP8"),
    "int8_wo": Format("W8A16", False, False, False, "INT8_WEIGHT_ONLY_CFG", "W8A16"),
    "int4_wo": Format("W4A16", True, False, False, "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "W4A16_AWQ"),
    "int4_awq": Format("W4A16_AWQ", True, True, True, "INT4_AWQ_CFG", "W4A16_AWQ"),
    # ModelOpt has no W4A16_GPTQ export: GPTQ weights are int4 blocks, exported under AWQ's name.
    "int4_gptq": Format("W4A16_GPTQ", True, True, False, "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "W4A16_AWQ"),
    "w4a8_awq": Format("W4A8_AWQ", True, True, True, "W4A8_AWQ_BETA_CFG", "W4A8_AWQ"),
    "int8_sq": Format("W8A8_SQ_PER_CHANNEL", False, True, True, "INT8_SMOOTHQUANT_CFG",
                      "W8A8_SQ_PER_CHANNEL"),
}
QFORMATS = tuple(FORMATS)
# What a mixture of experts' experts can be: per-expert weight scales, and FP8's per-tensor activation
# scales (ModelOpt's export takes the largest over the experts). AWQ/GPTQ/SmoothQuant would need per-expert
# input scales the fused op does not take.
MOE_QFORMATS = ("int8_wo", "int4_wo", "fp8")

# ModelOpt's AWQ algorithms for int4_awq (--awq_algorithm). "lite" searches one per-input-channel
# scale per linear (written as prequant_scaling_factor); "clip" searches, per weight group, the
# clipped range that minimizes the group's output error on calibration inputs (no pre-quant
# scale: plain int4 blocks under AWQ's name); "full" is lite then clip (the AWQ paper's method).
# On the default model at group 64 (benchmarks/awq_algorithms.py; 128 calibration windows, 32k
# held-out tokens) clip is the one clearly closer to the unquantized model than round-to-nearest:
# mean KL 0.0023 vs 0.0034, top-1 agreement 96.2% vs 95.3% (paired bootstrap 95% interval of the
# difference +0.64..+1.11 points); full gets KL 0.0029, top-1 95.5%, and lite is no better than
# round-to-nearest (its searched scales x^a / w^(1-a) cannot fall back to no scaling). Perplexity
# cannot tell them apart there: every difference to round-to-nearest is within +-0.15 points.
AWQ_ALGORITHMS = {"lite": "awq_lite", "clip": "awq_clip", "full": "awq_full"}
DEFAULT_AWQ_ALGORITHM = "clip"
KV_CACHE_ALGOS = {"fp8": "FP8", "int8": "INT8"}
KV_CACHE_DTYPES = tuple(KV_CACHE_ALGOS)

# The linears that are quantized, by TensorRT-LLM name; embedding and lm_head stay unquantized.
LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


def linear_prefixes(cfg: PretrainedConfig) -> list[str]:
    """Every quantized linear (a MoE layer's: its experts, stacked, and its shared expert; never the router)."""
    return [f"transformer.layers.{i}.{p}" for i in range(cfg.num_hidden_layers) for p in linear_shapes(cfg, i)]


def rank_inputs(cfg: PretrainedConfig) -> dict[str, int]:
    """The input size of every quantized linear as one tensor-parallel rank holds it: row-parallel
    linears (dense, proj) split their inputs across the ranks."""
    return {kind + name: inp // input_split(cfg, name, i)
            for kind, i in layer_kinds(cfg).items() for name, (_, inp) in linear_shapes(cfg, i).items()}


def writes_pre_quant_scale(qformat: str, awq_algorithm: str = DEFAULT_AWQ_ALGORITHM) -> bool:
    """Whether the format's linears carry prequant_scaling_factor (awq_clip's int4_awq does not)."""
    return FORMATS[qformat].pre_quant_scale and not (qformat == "int4_awq" and awq_algorithm == "clip")


def quant_config(qformat: str | None, kv_cache_dtype: str | None, group_size: int,
                 awq_algorithm: str = DEFAULT_AWQ_ALGORITHM) -> QuantConfig:
    if qformat is None:
        return QuantConfig(kv_cache_quant_algo=KV_CACHE_ALGOS.get(kv_cache_dtype))
    fmt = FORMATS[qformat]
    return QuantConfig(
        quant_algo=fmt.quant_algo,
        kv_cache_quant_algo=KV_CACHE_ALGOS.get(kv_cache_dtype),
        group_size=group_size if fmt.group_wise else QuantConfig.group_size,
        has_zero_point=False,
        pre_quant_scale=writes_pre_quant_scale(qformat, awq_algorithm),
        exclude_modules=["lm_head"],
    )


def default_group_size(cfg: PretrainedConfig) -> int:
    """The largest int4 group size the engine supports that divides every quantized linear's input size."""
    from kiln.models.linear import INT4_GROUP_SIZES

    inputs = sorted(set(rank_inputs(cfg).values()))
    fits = [g for g in INT4_GROUP_SIZES if all(i % g == 0 for i in inputs)]
    if not fits:
        raise ConfigError(f"no supported group size ({', '.join(map(str, INT4_GROUP_SIZES))}) divides every "
                          f"linear's input size ({', '.join(map(str, inputs))}); this model cannot be "
                          f"quantized group-wise")
    return max(fits)


def check_options(cfg: PretrainedConfig, qformat: str | None, kv_cache_dtype: str | None,
                  group_size: int, awq_algorithm: str = DEFAULT_AWQ_ALGORITHM) -> None:
    """Refuse, before any work, what the formats cannot represent for this model."""
    if qformat is not None and qformat not in FORMATS:
        raise ConfigError(f"--qformat {qformat!r} is not supported; expected one of {', '.join(QFORMATS)}")
    if awq_algorithm not in AWQ_ALGORITHMS:
        raise ConfigError(f"--awq_algorithm {awq_algorithm!r} is not supported; expected one of "
                          f"{', '.join(AWQ_ALGORITHMS)}")
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_ALGOS:
        raise ConfigError(f"--kv_cache_dtype {kv_cache_dtype!r} is not supported; expected one of "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    if qformat is not None and cfg.moe.num_experts and qformat not in MOE_QFORMATS:
        raise ConfigError(f"--qformat {qformat} is not supported for a mixture of experts ({cfg.architecture}) yet; "
                          f"expected one of {', '.join(MOE_QFORMATS)}")
    if qformat is None or not FORMATS[qformat].group_wise:
        return
    if group_size < 1:
        raise ConfigError(f"--group_size must be >= 1, got {group_size}")
    shapes = all_linear_shapes(cfg)
    for name, (out, inp) in shapes.items():
        if inp % group_size:
            raise ConfigError(
                f"--group_size {group_size} does not divide the input dimension {inp} of "
                f"{name} (shape [{out}, {inp}]); choose a group size that divides "
                f"{', '.join(map(str, sorted({s[1] for s in shapes.values()})))}")
        if out % 2:
            raise ConfigError(f"{name} has an odd output dimension {out}; int4 weights are packed "
                              f"two output rows per byte")
    tp = cfg.mapping.tp_size
    if tp == 1:
        return
    for name, inp in rank_inputs(cfg).items():
        if inp % group_size:
            raise ConfigError(f"--group_size {group_size} does not divide the input dimension {inp} that each of "
                              f"--tp_size {tp} ranks holds of {name}; choose a group size that divides "
                              f"{', '.join(map(str, sorted(set(rank_inputs(cfg).values()))))}")
    for name, layer in [("attention.qkv", 0)] + [("mlp.fc", i) for i in layer_kinds(cfg).values()]:
        if any(b % 2 for r in range(tp) for rng in output_ranges(cfg, name, r, layer) for b in rng):
            raise ConfigError(f"--tp_size {tp} splits {name} at an odd output row; int4 weights are packed "
                              f"two output rows per byte")
