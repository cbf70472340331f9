"""The GPU op set's GEMMs (kiln/plugins/gpu/gemm.py), run on CPU tensors in Triton's interpreter:
each op against the float32 references of kiln/plugins/quant.py (the spec) for token counts on
both sides of the tile-size switches and partial N and K tiles, and kiln.models.gpu_linear's
layers against kiln.models.linear's ATen ones for every quant_algo, fused and unfusable."""
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import require
from kiln.config import ConfigError, QuantConfig
from kiln.models import linear

require("triton", "the GPU op set's kernels need triton (pip install 'kiln-llm[gpu]')", module_level=True)

from kiln.models import gpu_linear  # noqa: E402
from kiln.plugins import quant  # noqa: E402
from kiln.plugins.gpu import gemm  # noqa: E402

ROWS = (1, 17, 40, 100, 300)  # 16-, 32-, 64-row tiles, 64 x 128 and 128 x 128 ones: each a partial last tile
DTYPES = (torch.float32, torch.bfloat16)
OP_DTYPES = DTYPES + (torch.float16,)
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def close(actual, expected, dtype, loose=1.0):
    """Within TOL[dtype] of the reference, relative to its largest output."""
    tol = TOL[dtype] * loose
    assert actual.dtype == dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol,
                               atol=tol * expected.float().abs().max().item())


def _x(m, k, dtype, g):
    return torch.randn(m, k, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", OP_DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(48, 96), (128, 64)])  # K = 1.5 K steps; N below one tile / two tiles
def test_w8a16_matches_reference(dtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    weight[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 0.001
    bias = torch.randn(n, generator=g).to(dtype)
    for m in ROWS:
        x = _x(m, k, dtype, g)
        close(torch.ops.kiln_gpu.w8a16(x, weight, scale, None), quant.ref_w8a16(x, weight, scale), dtype)
        close(torch.ops.kiln_gpu.w8a16(x, weight, scale, bias), quant.ref_w8a16(x, weight, scale, bias), dtype)
    # [..., K] inputs, read through their row stride
    x = _x(6, k + 16, dtype, g)[:, :k].reshape(2, 3, k)
    close(torch.ops.kiln_gpu.w8a16(x, weight, scale, bias), quant.ref_w8a16(x, weight, scale, bias), dtype)


def _int4(n, k, group, g):
    """(ModelOpt's packed int4 [n/2, k], its scale [n, k/g]), the int4 range's ends included."""
    q = torch.randint(-8, 8, (n, k), generator=g)
    q[0, :4] = torch.tensor([-8, 7, 7, -8])
    return quant.pack_int4(q), torch.rand(n, k // group, generator=g) * 0.02 + 0.001


@pytest.mark.parametrize("dtype", OP_DTYPES, ids=str)
@pytest.mark.parametrize("n,k,group", [(48, 96, 32), (64, 128, 128)])  # 3 groups of 1 step; 1 group of 2
def test_w4a16_matches_reference(dtype, n, k, group):
    g = torch.Generator().manual_seed(group)
    weight, scale = _int4(n, k, group, g)
    packed, scales = gemm.pack_int4(weight, scale, group)
    bias = torch.randn(n, generator=g).to(dtype)
    pqs = (torch.rand(k, generator=g) + 0.5).to(dtype)
    cases = [(None, None), (bias, None), (None, pqs), (bias, pqs)]  # two per row count, all four across them
    for i, m in enumerate(ROWS):
        x = _x(m, k, dtype, g)
        for b, p in (cases[i % 4], cases[(i + 1) % 4]):
            close(torch.ops.kiln_gpu.w4a16(x, packed, scales, group, b, p),
                  quant.ref_w4a16(x, weight, scale, group, p, b), dtype)


def test_int4_layout():
    """packed[n, j] = (q[n, 2j] + 8) | (q[n, 2j + 1] + 8) << 4; scales transposed to [K/g, N], float32."""
    g = torch.Generator().manual_seed(0)
    weight, scale = _int4(6, 64, 32, g)
    packed, scales = gemm.pack_int4(weight, scale.half(), 32)
    u = quant.unpack_int4(weight).int() + 8
    assert packed.dtype == torch.uint8 and packed.shape == (6, 32)
    assert torch.equal(packed.int(), u[:, 0::2] | (u[:, 1::2] << 4))
    assert scales.dtype == torch.float32 and torch.equal(scales, scale.half().float().T)


@pytest.mark.parametrize("dtype", OP_DTYPES, ids=str)
def test_fp8_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    n, k = 48, 64
    weight = (torch.randn(n, k, generator=g) * 0.5).to(quant.FP8)
    weight[0, :3] = torch.tensor([2.0 ** -9, -(2.0 ** -7), 448.0]).to(quant.FP8)  # subnormals and the max
    act, ws = torch.tensor(0.006), torch.tensor(0.002)  # |x| past 2.7 clips
    bias = torch.randn(n, generator=g).to(dtype)
    pqs = (torch.rand(k, generator=g) + 0.5).to(dtype)
    rows = torch.rand(n, generator=g) * 0.004 + 0.001  # per-row weight scales (fused parts')
    for m in ROWS:
        x = _x(m, k, dtype, g) * 2
        close(gemm.fp8(x, weight, act * ws, act), quant.ref_fp8(x, weight, ws, act), dtype)
        close(gemm.fp8(x, weight, act * ws, act, bias, pqs), quant.ref_fp8(x * pqs, weight, ws, act, bias), dtype)
        close(gemm.fp8(x, weight, act * rows, act, bias), quant.ref_fp8(x, weight, rows[:, None], act, bias), dtype)


def test_fakes_give_output_shapes():
    g = torch.Generator().manual_seed(2)
    weight, scale = _int4(64, 128, 32, g)
    packed, scales = gemm.pack_int4(weight, scale, 32)
    int8 = torch.zeros(48, 128, dtype=torch.int8)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(2, 5, 128, dtype=torch.bfloat16)
        assert torch.ops.kiln_gpu.w4a16(x, packed, scales, 32, None, None).shape == (2, 5, 64)
        y = torch.ops.kiln_gpu.w8a16(x, int8, torch.ones(48), torch.ones(48))
        assert y.shape == (2, 5, 48) and y.dtype == torch.bfloat16


# -- layers: gpu_linear against linear (ATen) ------------------------------------------------------

ALGOS = [None, "W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ", "FP8", "W8A8_SQ_PER_CHANNEL", "W4A8_AWQ"]
INPUT_SIDE = ("prequant_scaling_factor", "activation_scaling_factor")
LAYERS = {None: linear.Linear, "W8A16": gpu_linear.Int8Linear, "W4A16": gpu_linear.Int4Linear,
          "W4A16_AWQ": gpu_linear.Int4Linear, "W4A16_GPTQ": gpu_linear.Int4Linear, "FP8": gpu_linear.FP8Linear,
          "W8A8_SQ_PER_CHANNEL": gpu_linear.Int8Linear, "W4A8_AWQ": gpu_linear.FP8Linear}


def _config(algo, dtype, group=32, awq=False):
    return SimpleNamespace(dtype=str(dtype).split(".")[-1],
                           quantization=QuantConfig(quant_algo=algo, group_size=group, pre_quant_scale=awq))


def _tensor(algo, suffix, shape, kind, dtype, g):
    """A checkpoint tensor of linear.tensor_specs' kind, with values like ModelOpt's."""
    if kind in ("int4", torch.int8):  # any byte is two int4 values
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    if kind == quant.FP8:
        return (torch.randn(shape, generator=g) * 0.5).to(quant.FP8)
    if suffix == "weight":
        return (torch.randn(shape, generator=g) * 0.05).to(dtype)
    if suffix == "prequant_scaling_factor":
        return (torch.rand(shape, generator=g) + 0.5).to(dtype)
    if suffix == "activation_scaling_factor":
        return torch.rand(shape, generator=g) * 0.01 + (0.015 if algo == "W8A8_SQ_PER_CHANNEL" else 0.004)
    if suffix == "weights_scaling_factor_2":  # W4A8: the int4 weights' amax (8 * 0.021) near 448 * s2
        return torch.rand(shape, generator=g) * 0.0001 + 0.0004
    return torch.rand(shape, generator=g) * (0.02 if algo in linear.INT4_ALGOS else 0.004) + 0.001


def _checkpoint(config, algo, dtype, outs, inp, shared, seed):
    """weights for linears l.<i> of `outs` out dims; shared: the parts share their input-side scales."""
    g = torch.Generator().manual_seed(seed)
    weights, first = {}, {}
    for i, out in enumerate(outs):
        for key, (shape, kind) in linear.tensor_specs(config, f"l.{i}", out, inp).items():
            suffix = key[len(f"l.{i}."):]
            if shared and suffix in first:
                weights[key] = first[suffix]
                continue
            weights[key] = _tensor(algo, suffix, shape, kind, dtype, g)
            if suffix in INPUT_SIDE:
                first[suffix] = weights[key]
    return weights


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("algo", ALGOS, ids=str)
def test_make_linear_matches_linear(algo, dtype):
    group = 128 if algo in ("W4A16_AWQ", "W4A8_AWQ") else 32
    config = _config(algo, dtype, group, awq=algo == "W4A16_AWQ")
    g = torch.Generator().manual_seed(3)
    inp, outs = 128, (64, 32, 32)
    names = [f"l.{i}" for i in range(len(outs))]
    x = torch.randn(17, inp, generator=g).to(dtype)

    def both(weights, names, bias=None):
        return (gpu_linear.make_linear(config, weights, names, bias),
                linear.make_linear(config, weights, names, bias, packed=False))

    # qkv: one GEMM, with a bias (FP8: the parts' weight scales differ, so per-row scales)
    weights = _checkpoint(config, algo, dtype, outs, inp, True, 4)
    ours, theirs = both(weights, names, torch.randn(sum(outs), generator=g).to(dtype))
    assert type(ours) is LAYERS[algo]
    close(ours(x), theirs(x), dtype, loose=2)
    # parts whose input-side scales differ (AWQ's fc and gate): separate GEMMs
    weights = _checkpoint(config, algo, dtype, outs[:2], inp, False, 5)
    ours, theirs = both(weights, names[:2])
    assert isinstance(ours, linear.ConcatLinear) == isinstance(theirs, linear.ConcatLinear)
    assert isinstance(ours, linear.ConcatLinear) == any(k.endswith(INPUT_SIDE) for k in weights)
    close(ours(x), theirs(x), dtype, loose=2)


def test_quantized_activation_layers_match_reference():
    """W8A8 and W4A8 layers hold the folded scales: against ref_w8a8 / ref_w4a8, float32."""
    g = torch.Generator().manual_seed(6)
    k, n, group = 64, 48, 32
    x = torch.randn(17, k, generator=g)
    pqs, act = torch.rand(k, generator=g) + 0.5, torch.tensor(0.02)
    weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    ws = torch.rand(n, generator=g) * 0.01
    layer = gpu_linear.Int8Linear(weight, act * ws, None, pqs, act)
    close(layer(x), quant.ref_w8a8(x, weight, ws, act, pqs), torch.float32)
    packed, scale = _int4(n, k, group, g)
    s2, act = torch.tensor(0.0004), torch.tensor(0.006)
    parts = [dict(weight=packed, weights_scaling_factor=scale, weights_scaling_factor_2=s2)]
    w_fp8, folded = linear._fp8_weight_and_scale("W4A8_AWQ", parts, act, group)
    layer = gpu_linear.FP8Linear(w_fp8, folded, act, None, pqs)
    close(layer(x), quant.ref_w4a8(x, packed, scale, s2, act, group, pqs), torch.float32)


def test_bad_input_is_a_config_error():
    g = torch.Generator().manual_seed(7)
    weight, scale = _int4(64, 96, 32, g)
    with pytest.raises(ConfigError, match="group_size 48 is not supported; expected one of 32, 64, 128, 256"):
        gemm.pack_int4(weight, scale, 48)
    with pytest.raises(ConfigError, match=r"group_size 64 does not divide the input dim \(96\)"):
        gemm.pack_int4(weight, scale, 64)
    config = _config("NVFP4", torch.bfloat16)
    with pytest.raises(ConfigError, match="'NVFP4' is not supported by the GPU GEMMs; expected one of W8A16"):
        gpu_linear.make_linear(config, {"l.0.weight": torch.zeros(8, 8)}, ["l.0"])
    fp8 = torch.zeros(40, 64, dtype=quant.FP8)
    with pytest.raises(ConfigError, match=r"\[40, 64\] is not supported.*multiples of 16"):
        gpu_linear.FP8Linear(fp8, torch.tensor(1.0), torch.tensor(1.0))
