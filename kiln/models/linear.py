"""Linear layers built from a rank's checkpoint tensors: one class per quant_algo.

A layer is built from one or more checkpoint linears that share their input (qkv; mlp.fc + mlp.gate)
and runs them as one GEMM whose output rows are the parts' rows in order. Per-channel and per-group
scales concatenate along the output dim and per-tensor weight scales become per-row ones, so fusing
is exact; parts whose input-side scales differ (AWQ smooths mlp.fc and mlp.gate separately) run as
separate GEMMs whose outputs are concatenated. With packed=True (gemm_plugin "cpp") every layer is a
PackedLinear on the C++ GEMM plugin instead of ATen's kernels.

Pre-quantized checkpoints add zero points (`zero`), per-channel and per-token FP8 and act-order's
`input_index` (kiln/plugins/quant.py says what each means). A gather is one InputGather around the
family's layer, so linears fuse only where their input_index is the same.
"""
from fnmatch import fnmatch

import torch
from torch import nn

from kiln.config import ConfigError, PretrainedConfig, torch_dtype
from kiln.plugins import gemm, quant

INT4_ALGOS = ("W4A16", "W4A16_AWQ", "W4A16_GPTQ", "W4A8_AWQ")
FP8_PER_TOKEN = "FP8_PER_CHANNEL_PER_TOKEN"
SUPPORTED_QUANT_ALGOS = ("W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ", "FP8", FP8_PER_TOKEN, "W8A8_SQ_PER_CHANNEL",
                         "W4A8_AWQ")
ZERO_POINT_ALGOS = ("W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ")
SUPPORTED_KV_CACHE_QUANT_ALGOS = ("FP8", "INT8")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu takes

# Tensor kinds a checkpoint entry must have: "model" (any float, cast to the model dtype), "scale"
# (any float, kept float32), "int4" (int8/uint8 holding two int4), or an exact torch dtype.
INT8, FP8 = torch.int8, quant.FP8


class Spec(tuple):
    """(shape, kind) of a checkpoint tensor, unpacking as that pair; `shapes`: every shape the file may
    hold (an FP8 weight scale per tensor or per channel), `optional`: the file may lack it (input_index)."""

    def __new__(cls, shape, kind, shapes=(), optional=False):
        spec = super().__new__(cls, (shape, kind))
        spec.shapes, spec.optional = tuple(shapes) or (shape,), optional
        return spec


def stacked(spec, n: int):
    """The spec of n such tensors stacked (a mixture's experts)."""
    shape, kind = spec
    return Spec((n, *shape), kind, [(n, *s) for s in getattr(spec, "shapes", ())], getattr(spec, "optional", False))


def quant_algo_of(config: PretrainedConfig, name: str) -> str | None:
    """The quant_algo of linear `name` (e.g. transformer.layers.0.mlp.fc), None when excluded."""
    q = config.quantization
    if not q.quant_algo or any(fnmatch(name, pat) or fnmatch(name.split(".")[-1], pat)
                               for pat in q.exclude_modules or []):
        return None
    return q.quant_algo


def has_pre_quant_scale(config: PretrainedConfig) -> bool:
    algo = config.quantization.quant_algo
    return algo in ("W8A8_SQ_PER_CHANNEL", "W4A8_AWQ") or (algo in INT4_ALGOS and config.quantization.pre_quant_scale)


def tensor_specs(config: PretrainedConfig, name: str, out: int, inp: int,
                 optional: bool = False) -> dict[str, tuple[tuple, object]]:
    """name.suffix -> (shape, kind) for the tensors of checkpoint linear `name` [out, in]; optional: with
    the ones a file may lack (Spec.optional), which the loader takes where present."""
    algo, g = quant_algo_of(config, name), config.quantization.group_size
    specs = {"weight": ((out, inp), "model")}
    if algo == "W8A16":
        specs = {"weight": ((out, inp), INT8), "weights_scaling_factor": ((out,), "scale")}
    elif algo in INT4_ALGOS:
        specs = {"weight": ((out // 2, inp), "int4"), "weights_scaling_factor": ((out, inp // g), "scale")}
        if algo == "W4A8_AWQ":
            specs.update(weights_scaling_factor_2=((1,), "scale"), activation_scaling_factor=((1,), "scale"))
    elif algo == "FP8":
        specs = {"weight": ((out, inp), FP8), "weights_scaling_factor": Spec((1,), "scale", [(1,), (out,)]),
                 "activation_scaling_factor": ((1,), "scale")}
    elif algo == FP8_PER_TOKEN:
        specs = {"weight": ((out, inp), FP8), "weights_scaling_factor": ((out,), "scale")}
    elif algo == "W8A8_SQ_PER_CHANNEL":
        specs = {"weight": ((out, inp), INT8), "weights_scaling_factor": ((out,), "scale"),
                 "activation_scaling_factor": ((1,), "scale")}
    if algo and has_pre_quant_scale(config):
        specs["prequant_scaling_factor"] = ((inp,), "model")
    if algo in ZERO_POINT_ALGOS and config.quantization.has_zero_point:
        specs["zero"] = (specs["weights_scaling_factor"][0], "scale")
    if algo and optional:
        specs["input_index"] = Spec((inp,), torch.int32, optional=True)
    return {f"{name}.{suffix}": spec for suffix, spec in specs.items()}


def check_quantization(config: PretrainedConfig) -> None:
    q = config.quantization
    if q.quant_algo and q.quant_algo not in SUPPORTED_QUANT_ALGOS:
        raise ConfigError(f"quantization.quant_algo {q.quant_algo!r} is not supported; expected one of "
                          f"{', '.join(SUPPORTED_QUANT_ALGOS)}")
    if q.kv_cache_quant_algo and q.kv_cache_quant_algo not in SUPPORTED_KV_CACHE_QUANT_ALGOS:
        raise ConfigError(f"quantization.kv_cache_quant_algo {q.kv_cache_quant_algo!r} is not supported; "
                          f"expected one of {', '.join(SUPPORTED_KV_CACHE_QUANT_ALGOS)}")
    if q.has_zero_point and q.quant_algo not in ZERO_POINT_ALGOS:
        raise ConfigError(f"quantization.has_zero_point true is not supported for {q.quant_algo}; expected "
                          f"one of {', '.join(ZERO_POINT_ALGOS)} (or has_zero_point false)")
    if q.has_zero_point or q.quant_algo == FP8_PER_TOKEN:
        what = "zero points" if q.has_zero_point else q.quant_algo
        for i in range(config.num_hidden_layers):  # the MoE ops' expert GEMMs take neither
            if config.is_moe_layer(i) and quant_algo_of(config, f"transformer.layers.{i}.mlp.fc"):
                raise ConfigError(f"quantization: {what} on a mixture of experts' experts (layer {i}) are not "
                                  f"supported; exclude them (exclude_modules) or quantize them otherwise")
    if q.quant_algo in INT4_ALGOS:
        if q.group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"quantization.group_size {q.group_size} is not supported; expected one of "
                              f"{', '.join(map(str, INT4_GROUP_SIZES))}")
        for dim in ("hidden_size", "intermediate_size"):
            if getattr(config, dim) % q.group_size:
                raise ConfigError(f"quantization.group_size {q.group_size} does not divide {dim} "
                                  f"({getattr(config, dim)})")


class Linear(nn.Module):
    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


class _Quantized(nn.Module):
    def __init__(self, bias, **tensors):
        super().__init__()
        for key, value in tensors.items():
            self.register_buffer(key, value)
        self.bias = bias


class W8A16Linear(_Quantized):
    def forward(self, x):
        y = quant.w8a16(x, self.weight, self.scale, self.bias)
        zero = getattr(self, "zero", None)  # [out, 1]: ATen's int8 kernel takes no zero point
        return y if zero is None else (y + quant.zero_term(x, zero)).to(x.dtype)


class W4A16Linear(_Quantized):
    def __init__(self, bias, group_size, **tensors):
        super().__init__(bias, **tensors)
        self.group_size = group_size

    def forward(self, x):
        return quant.w4a16(x, self.weight, self.scales_and_zeros, self.group_size,
                           getattr(self, "pre_quant_scale", None), self.bias)


class FP8Linear(_Quantized):
    def forward(self, x):
        return quant.fp8(x, self.weight, self.scale, self.act_scale, getattr(self, "pre_quant_scale", None),
                         self.bias).to(x.dtype)


class FP8PerTokenLinear(_Quantized):
    def forward(self, x):
        return quant.fp8_per_token(x, self.weight, self.scale, self.bias)


class W8A8Linear(_Quantized):
    def forward(self, x):
        return quant.w8a8(x, self.weight, self.scale, self.act_scale, self.pre_quant_scale, self.bias)


class InputGather(nn.Module):
    """Act-order (GPTQ desc_act): the layer's input columns in the order its weight was quantized."""

    def __init__(self, index, layer):
        super().__init__()
        self.register_buffer("index", index.long())
        self.layer = layer

    def forward(self, x):
        return self.layer(x.index_select(-1, self.index))


class ConcatLinear(nn.Module):
    def __init__(self, parts):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x):
        return torch.cat([p(x) for p in self.parts], dim=-1)


class PackedLinear(nn.Module):
    """A linear on the C++ GEMM plugin (`kiln_cpp::gemm`), its weight packed by kiln.plugins.gemm.

    The kernel decodes bf16/fp16/int8/fp8/int4 weights in its inner loop. A quantized activation
    (SmoothQuant's int8, FP8's fp8) is rounded to its grid here, in the graph, and rides the kernel
    as exact values in x's dtype; scale folds the activation and weight scales per column.
    `tactics` (set by engine-build's timing, kiln.plugins.tactics) picks the kernel per token count."""

    def __init__(self, weight, n, k, scale=None, bias=None, group_size=0, pre_quant_scale=None,
                 act_scale=None, act_dtype=None, out_float=False):
        super().__init__()
        for key, value in dict(weight=weight, scale=scale, bias=bias, pre_quant_scale=pre_quant_scale,
                               act_scale=act_scale).items():
            self.register_buffer(key, value)
        self.n, self.k, self.group_size, self.act_dtype, self.out_float = n, k, group_size, act_dtype, out_float
        self.tactics: tuple[int, ...] = ()
        # A gated MLP's [gate; up] that the model runs through swiglu() (its tactics are timed so)
        self.swiglu = False

    def _input(self, x):
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        if self.act_dtype is not None:
            x = quant.quantize_to(x, self.act_scale, self.act_dtype).to(x.dtype)
        return x

    def forward(self, x):
        return gemm.gemm(self._input(x), self.weight, self.scale, self.bias, self.n, self.group_size, self.out_float,
                         self.tactics)

    def rows(self, ids, dtype):
        """Rows `ids` of the weight as an embedding table (a packed lm_head tied to the embedding)."""
        return gemm.embedding(self.weight, ids, self.n, self.k, self.scale, self.group_size, dtype)

    def forward_swiglu(self, x):
        """silu(gate) * up of this [gate; up] linear, in one call (`kiln_cpp::gemm_swiglu`)."""
        return gemm.gemm_swiglu(self._input(x), self.weight, self.scale, self.bias, self.n, self.group_size,
                                self.tactics)


class PackedEpilogueLinear(PackedLinear):
    """A PackedLinear whose output takes terms the kernel lacks: zero points' share of the GEMM
    (quant.zero_term of its input) and FP8_PER_CHANNEL_PER_TOKEN's per-token scale, whose rounded
    activation rides the kernel as FP8's does. The kernel writes float32 (bias added after the token
    scale) and the output rounds to x's dtype once, after the terms. Never fused with SiLU: the terms
    land before the activation."""

    def __init__(self, weight, n, k, scale=None, bias=None, group_size=0, pre_quant_scale=None, zero=None,
                 per_token=False):
        super().__init__(weight, n, k, scale, None if per_token else bias, group_size, pre_quant_scale,
                         out_float=True)
        self.register_buffer("zero", zero)
        self.register_buffer("token_bias", bias if per_token else None)
        self.per_token = per_token

    @property
    def swiglu(self):
        return False  # what engine-build times: the plain GEMM, which forward_swiglu runs

    @swiglu.setter
    def swiglu(self, fused):
        pass

    def forward(self, x):
        xs = x if self.pre_quant_scale is None else x * self.pre_quant_scale
        xk = xs
        if self.per_token:
            s = quant.token_scale(xs)
            xk = quant.quantize_fp8(xs, s).to(x.dtype)
        y = gemm.gemm(xk, self.weight, self.scale, self.bias, self.n, self.group_size, True, self.tactics)
        if self.per_token:
            y = y * s if self.token_bias is None else y * s + self.token_bias
        if self.zero is not None:
            y = y + quant.zero_term(xs, self.zero)
        return y.to(x.dtype)

    def forward_swiglu(self, x):
        gate, up = self.forward(x).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def packed_lm_head(config: PretrainedConfig, weight: torch.Tensor, quantize: str = "none") -> PackedLinear:
    """The vocab GEMM (float32 logits) on the plugin. quantize (engine-build --quantize_lm_head,
    resolved by kiln.build.settings.lm_head_quantization): "int8" per row, "int4" with the checkpoint's
    group size (else the largest of 64 and 32 dividing K), both round-to-nearest at build time, or
    "none"."""
    n, k = weight.shape
    if quantize == "none":
        return PackedLinear(gemm.pack(weight), n, k, out_float=True)
    w = weight.float()
    if quantize == "int4":
        algo = config.quantization.quant_algo
        g = config.quantization.group_size if algo in INT4_ALGOS else next((g for g in (64, 32) if k % g == 0), 0)
        if not g or k % g:
            raise ConfigError(f"an int4 lm_head needs a group size dividing hidden_size ({k}); "
                              f"use --quantize_lm_head int8")
        # ModelOpt's int4 RTN (amax / 7), at the float16 scale the packed copy keeps
        scale = (w.view(n, -1, g).abs().amax(-1) / 7).clamp(min=1e-7).half().float()
        q = (w.view(n, -1, g) / scale[..., None]).round().clamp(-8, 7).view(n, -1)
        packed, scales = gemm.pack_int4(q, scale, g)
        return PackedLinear(packed, n, k, scales, group_size=g, out_float=True)
    scale = (w.abs().amax(-1) / 127).clamp(min=1e-10)
    return PackedLinear(gemm.pack(quant.quantize_int8(w, scale[:, None])), n, k, gemm.pack_scale(scale, n),
                        out_float=True)


class _NotFusable(Exception):
    pass


def _shared(parts, key):
    first = parts[0][key]
    if any(not torch.equal(p[key], first) for p in parts[1:]):
        raise _NotFusable(key)
    return first


def _input_side(parts, key):
    """A tensor the parts' shared input goes through (pre-quant scale, input_index): None where no part
    has it; parts that differ (or one without) are not one GEMM."""
    have = [key in p for p in parts]
    if not any(have):
        return None
    if not all(have):
        raise _NotFusable(key)
    return _shared(parts, key)


def _zero(parts):
    """The parts' zero points as [out, groups] float32 (a W8A16 per-channel one [out, 1]); None without."""
    if "zero" not in parts[0]:
        return None
    return torch.cat([p["zero"].float().reshape(p["weights_scaling_factor"].shape[0], -1) for p in parts])


def _fp8_weight_and_scale(algo, parts, act_scale, group_size):
    """FP8 and W4A8: the fp8 weight and act_scale * its scale, per tensor or per row (fused parts'
    per-tensor scales that differ, or FP8's per-channel ones)."""
    if algo == "W4A8_AWQ":
        # No CPU kernel takes int4 weights with fp8 activations: the int4 weights become the fp8
        # ones they stand for (exactly) once, at build time.
        weight = torch.cat([quant.w4a8_weight_fp8(p["weight"], p["weights_scaling_factor"],
                                                  p["weights_scaling_factor_2"], group_size) for p in parts])
        second = "weights_scaling_factor_2"
    else:
        weight, second = torch.cat([p["weight"] for p in parts]), "weights_scaling_factor"
    rows = [p["weight"].shape[0] * (2 if algo == "W4A8_AWQ" else 1) for p in parts]
    scales = [p[second].reshape(-1) for p in parts]
    if all(s.numel() == 1 and torch.equal(s, scales[0]) for s in scales):
        return weight, act_scale * scales[0].reshape(())
    return weight, act_scale * torch.cat([s.expand(n) for s, n in zip(scales, rows)])


def _build(algo, parts, dtype, group_size, bias):
    cat = lambda key: torch.cat([p[key] for p in parts])  # noqa: E731
    pqs = _shared(parts, "prequant_scaling_factor") if "prequant_scaling_factor" in parts[0] else None
    extra = {} if pqs is None else {"pre_quant_scale": pqs.to(dtype)}
    if algo is None:
        return Linear(cat("weight").to(dtype), bias)
    zero = _zero(parts)
    if algo == "W8A16":
        return W8A16Linear(bias, weight=cat("weight"), scale=cat("weights_scaling_factor").to(dtype),
                           **({} if zero is None else {"zero": zero}))
    if algo in INT4_ALGOS and algo != "W4A8_AWQ":
        weight, scales_and_zeros = quant.int4_for_cpu(cat("weight"), cat("weights_scaling_factor"), group_size, dtype,
                                                      zero)
        return W4A16Linear(bias, group_size, weight=weight, scales_and_zeros=scales_and_zeros, **extra)
    if algo == FP8_PER_TOKEN:
        return FP8PerTokenLinear(bias, weight=cat("weight"), scale=cat("weights_scaling_factor").float())
    act_scale = _shared(parts, "activation_scaling_factor").reshape(())
    if algo == "W8A8_SQ_PER_CHANNEL":
        return W8A8Linear(bias, weight=cat("weight"), act_scale=act_scale,
                          scale=(act_scale * cat("weights_scaling_factor")).to(dtype), **extra)
    weight, scale = _fp8_weight_and_scale(algo, parts, act_scale, group_size)
    return FP8Linear(bias, weight=weight, scale=scale, act_scale=act_scale, **extra)


def _build_packed(algo, parts, dtype, group_size, bias):
    cat = lambda key: torch.cat([p[key] for p in parts])  # noqa: E731
    pqs = _shared(parts, "prequant_scaling_factor") if "prequant_scaling_factor" in parts[0] else None
    pqs = None if pqs is None else pqs.to(dtype)
    n = sum(p["weight"].shape[0] for p in parts) * (2 if algo in INT4_ALGOS else 1)
    k = parts[0]["weight"].shape[1]
    bias = None if bias is None else bias.float()
    if algo is None:
        return PackedLinear(gemm.pack(cat("weight").to(dtype)), n, k, bias=bias)
    zero = _zero(parts)
    if algo == "W8A16":
        weight, scale = gemm.pack(cat("weight")), gemm.pack_scale(cat("weights_scaling_factor"), n)
        return PackedLinear(weight, n, k, scale, bias) if zero is None else \
            PackedEpilogueLinear(weight, n, k, scale, bias, zero=zero)
    if algo in INT4_ALGOS and algo != "W4A8_AWQ":
        weight, scale = gemm.pack_int4(quant.unpack_int4(cat("weight")), cat("weights_scaling_factor"), group_size)
        return PackedLinear(weight, n, k, scale, bias, group_size, pqs) if zero is None else \
            PackedEpilogueLinear(weight, n, k, scale, bias, group_size, pqs, zero)
    if algo == FP8_PER_TOKEN:
        return PackedEpilogueLinear(gemm.pack(cat("weight")), n, k, gemm.pack_scale(cat("weights_scaling_factor"), n),
                                    bias, per_token=True)
    act_scale = _shared(parts, "activation_scaling_factor").reshape(()).float()
    if algo == "W8A8_SQ_PER_CHANNEL":
        weight, scale, act_dtype = cat("weight"), act_scale * cat("weights_scaling_factor"), torch.int8
    else:
        (weight, scale), act_dtype = _fp8_weight_and_scale(algo, parts, act_scale, group_size), FP8
    return PackedLinear(gemm.pack(weight), n, k, gemm.pack_scale(scale, n), bias, 0, pqs, act_scale, act_dtype)


def make_linear(config: PretrainedConfig, weights: dict, names: list[str], bias=None, packed=False,
                build=None) -> nn.Module:
    """One layer for the checkpoint linears `names` (full names, sharing their input), fused where exact;
    packed: on the C++ GEMM plugin instead of ATen's kernels; build: another family's layers, with
    _build's signature (kiln/models/gpu_linear.py)."""
    algo, dtype, g = quant_algo_of(config, names[0]), torch_dtype(config.dtype), config.quantization.group_size
    parts = [{key[len(n) + 1:]: t for key, t in weights.items() if key.startswith(n + ".") and key != n + ".bias"}
             for n in names]
    build = build or (_build_packed if packed else _build)
    try:
        return _gathered(build, algo, parts, dtype, g, bias)
    except _NotFusable:
        assert bias is None, "only qkv has a bias, and it is one checkpoint linear"
        return ConcatLinear([_gathered(build, algo, [p], dtype, g, None) for p in parts])


def _gathered(build, algo, parts, dtype, group_size, bias):
    """build's layer, behind the parts' shared input_index where they have one (every family's the same)."""
    index = _input_side(parts, "input_index")
    layer = build(algo, [{k: t for k, t in p.items() if k != "input_index"} for p in parts], dtype, group_size, bias)
    return layer if index is None else InputGather(index, layer)
