"""The C++ GEMM plugin (kiln_cpp::gemm): every kernel that runs on this machine, for every weight
format, held to the plain-torch reference, for row counts on both sides of each kernel's internal
switches (direct / blocked, 16- and 32-row AMX tiles), partial last panels, K that is not a whole
number of stored rows or tiles, bias and output dtypes; thread-count independence; the DEFAULT (no
AVX2) build and capped instruction sets in subprocesses; then engines built on it against engines
on ATen. Kernels for instructions this CPU lacks are skipped with a message naming the flag."""
import json
import os
import subprocess
import sys

import pytest
import torch

from kiln.plugins import cpp, gemm, quant
from kiln import LLM, SamplingParams

from test_e2e import kiln_ops
from tiny_models import PROMPTS

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 31, 32, 33, 64]
FORMATS = ["float32", "bfloat16", "float16", "int8", "fp8", "int4"]
# kernel -> the CPU feature it needs beyond AVX2 (None: runs everywhere)
KERNELS = {"portable": None, "avx2": "avx2", "avx512_bf16": "avx512_bf16", "amx_bf16": "amx_bf16", "aten": None,
           "avx2_int8": "avx2", "avx512_vnni": "avx512_vnni", "portable_int8": None}
INT8_ACT = ("avx2_int8", "avx512_vnni", "portable_int8")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _weights(fmt, n, k, group_size=32, seed=0):
    """(packed, scale, group_size, the dense float32 weight it stands for, including its scales)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    if fmt in ("float32", "bfloat16", "float16"):
        wq = w.to(getattr(torch, fmt))
        return gemm.pack(wq), None, 0, wq.float()
    if fmt == "int8":
        scale = torch.rand(n, generator=g) * 0.01 + 0.001
        q = quant.quantize_int8(w, scale[:, None])
        q[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)  # the ends of the range
        return gemm.pack(q), gemm.pack_scale(scale, n), 0, q.float() * scale[:, None]
    if fmt == "fp8":
        scale = torch.tensor([0.01])
        q = quant.quantize_fp8(w, scale)
        q[0, :3] = torch.tensor([2.0 ** -9, -(2.0 ** -7), 448.0]).to(quant.FP8)  # subnormals and the max
        return gemm.pack(q), gemm.pack_scale(scale, n), 0, q.float() * scale
    q = torch.randint(-8, 8, (n, k), generator=g)
    scale = (torch.rand(n, k // group_size, generator=g) * 0.02 + 0.001).half().float()  # as packed: float16
    packed, gs = gemm.pack_int4(q, scale, group_size)
    return packed, gs, group_size, q.float() * scale.repeat_interleave(group_size, dim=1)


ACT_BLOCK = 128  # gemm.h's kMaxActBlock


def act_block(fmt, group_size):
    """k per activation scale: 128 for int8 weights, an int4 group up to that."""
    return min(group_size, ACT_BLOCK) if fmt == "int4" else ACT_BLOCK


def int8_activations(x, k, block):
    """The int8-activation kernels' x: per `block` k, scale max|x| / 127, round half to even."""
    m, kp = x.shape[0], -(-k // block) * block
    blocks = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # a true division
    return (torch.round(blocks * inv) * (amax / 127.0)).view(m, kp)[:, :k]


def kernel_id(name):
    from kiln.plugins import tactics

    return tactics.kernel_ids()[name]


def _require(name):
    flag = KERNELS[name]
    cpp.load()
    if flag is not None and flag not in torch.ops.kiln_cpp.cpu_features().split(","):
        pytest.skip(f"{name}: this CPU (or KILN_CPU_ISA / ATEN_CPU_CAPABILITY) lacks {flag}")


def _check(fmt, kernel, n, k, rows, out_float=True, bias=True, group_size=32):
    packed, scale, group_size, dense = _weights(fmt, n, k, group_size)
    torch.manual_seed(n * k)
    b = torch.randn(n) if bias else None
    for m in rows:
        bf16_x = KERNELS[kernel] in ("avx512_bf16", "amx_bf16") or m % 2 == 0
        x = torch.randn(m, k).to(torch.bfloat16 if bf16_x else torch.float32)
        xe = int8_activations(x, k, act_block(fmt, group_size)) if kernel in INT8_ACT else x.float()
        want = xe @ dense.T + (0 if b is None else b)
        got = gemm.gemm(x, packed, scale, b, n, group_size, out_float, (1 << 40, kernel_id(kernel)))
        assert got.shape == (m, n) and got.dtype == (torch.float32 if out_float else x.dtype)
        # Weights the bf16 kernels round (float32, fp16, int4 after its group scale) and bf16 outputs
        # are each off by up to 2^-9 of the sum of |products| (oneDNN's bf16 output, measured, up to
        # twice that); the rest only by float32 summation order.
        bf16 = x.dtype == torch.bfloat16
        roundings = ((kernel in ("avx512_bf16", "amx_bf16") and fmt in ("float32", "float16", "int4") and bf16)
                     + (kernel == "aten" and fmt != "bfloat16" and bf16)  # ATen's dense weight folds in the scales
                     + (bf16 and (kernel == "aten" or not out_float)) * (2 if kernel == "aten" else 1))
        bound = (xe.abs() @ dense.abs().T) * (roundings * 2 ** -9 + 1e-5) + 1e-5
        err = (got.float() - want).abs()
        assert (err <= bound).all(), f"{kernel} {fmt} M={m} x {x.dtype}: max error {err.max():.3g}"


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k not in INT8_ACT])
@pytest.mark.parametrize("fmt", FORMATS)
# 40 x 64: a partial last panel; 200 x 96: 13 panels (several read at once, odd pairs) and K not a
# whole AMX tile; 24 x 37: odd K (x padded to whole k pairs/quads)
@pytest.mark.parametrize("n,k", [(40, 64), (200, 96), (24, 37)])
def test_float_kernels_match_reference(kernel, fmt, n, k):
    if fmt == "int4" and k % 32:
        pytest.skip("int4 needs K divisible by its group size")
    _require(kernel)
    _check(fmt, kernel, n, k, ROWS if kernel != "portable" else [1, 7, 17])


@pytest.mark.parametrize("kernel", INT8_ACT)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
# (24, 320): activation blocks of 128, 128 and 64 k (int8), five groups of 64 (int4); (16, 512) at
# group 256: two activation blocks per group
@pytest.mark.parametrize("n,k,group_size", [(40, 64, 32), (200, 96, 32), (24, 40, 32), (24, 320, 64), (16, 512, 256)])
def test_int8_activation_kernels_match_reference(kernel, fmt, n, k, group_size):
    if fmt == "int4" and k % 32:
        pytest.skip("int4 needs K divisible by its group size")
    if fmt == "int8" and group_size == 256:
        pytest.skip("int8 weights have no groups")
    _require(kernel)
    _check(fmt, kernel, n, k, ROWS if kernel != "portable_int8" else [1, 5, 9], group_size=group_size)


@pytest.mark.parametrize("kernel", ["avx2", "avx512_bf16", "amx_bf16", "aten", "avx512_vnni"])
@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4", "fp8"])
# 64 x 64: two gate and two up panels; 96 x 64: an odd count of each; 80 x 64: gate and up meet
# inside a panel (not fused: the kernels write y, a second pass activates it)
@pytest.mark.parametrize("n,k", [(64, 64), (96, 64), (80, 64)])
def test_gemm_swiglu_matches_reference(kernel, fmt, n, k):
    """gemm_swiglu = silu(y[:, :n/2]) * y[:, n/2:] of the GEMM y, whether the kernel fuses it
    (AMX, AVX-512-BF16: on the float accumulators, rounded once) or not."""
    if kernel in INT8_ACT and fmt not in ("int8", "int4"):
        pytest.skip("the int8-activation kernels take int8 and int4 weights")
    _require(kernel)
    packed, scale, group_size, dense = _weights(fmt, n, k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(1))
    h = n // 2
    for m in (1, 5, 16, 33):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        xe = int8_activations(x, k, act_block(fmt, group_size)) if kernel in INT8_ACT else x.float()
        y = xe @ dense.T + b
        g, u = y[:, :h], y[:, h:]
        want = torch.nn.functional.silu(g) * u
        got = gemm.gemm_swiglu(x, packed, scale, b, n, group_size, (1 << 40, kernel_id(kernel)))
        assert got.shape == (m, h) and got.dtype == torch.bfloat16
        # y's error as in _check (bf16 weights rounded, y rounded to bf16 where not fused), carried
        # through silu(g) * u (|silu'| < 1.1), plus the output's own bf16 rounding
        roundings = (kernel in ("avx512_bf16", "amx_bf16") and fmt in ("float16", "int4")) + 2
        e = (xe.abs() @ dense.abs().T) * (roundings * 2 ** -9 + 1e-5) + 1e-5 + y.abs() * 2 ** -9
        bound = 1.1 * u.abs() * e[:, :h] + torch.nn.functional.silu(g).abs() * e[:, h:] + want.abs() * 2 ** -8 + 1e-4
        err = (got.float() - want).abs()
        assert (err <= bound).all(), f"{kernel} {fmt} n={n} M={m}: max error {err.max():.3g}"


def test_gemm_swiglu_bad_n():
    packed, _, _, _ = _weights("bfloat16", 48, 64)
    with pytest.raises(RuntimeError, match="gemm_swiglu needs n = 2 x the gated width"):
        gemm.gemm_swiglu(torch.randn(2, 64).bfloat16(), packed, None, None, 47)


def test_output_dtypes_and_leading_dims():
    for name in ("avx2", "avx512_bf16", "amx_bf16"):
        if KERNELS[name] in torch.ops.kiln_cpp.cpu_features().split(","):
            _check("bfloat16", name, 40, 64, [1, 5, 17], out_float=False, bias=False)
    packed, _, _, dense = _weights("bfloat16", 40, 64)
    x = torch.randn(2, 3, 64, dtype=torch.float16)  # leading dims kept; fp16 out
    got = gemm.gemm(x, packed, None, None, 40)
    assert got.shape == (2, 3, 40) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), x.float() @ dense.T, rtol=2e-3, atol=1e-3)
    assert gemm.gemm(torch.randn(0, 64), packed, None, None, 40).shape == (0, 40)


def test_results_do_not_depend_on_threads():
    """Each output is one thread's, summed in one order however the panels were split or grouped."""
    before = torch.get_num_threads()
    features = torch.ops.kiln_cpp.cpu_features().split(",")
    try:
        for fmt, names in (("bfloat16", ("avx2", "avx512_bf16", "amx_bf16")), ("int4", ("avx2_int8", "avx512_vnni"))):
            packed, scale, g, _ = _weights(fmt, 200, 64)
            for name in (n for n in names if KERNELS[n] in features):
                for m in (1, 2, 7, 17, 33):
                    x = torch.randn(m, 64).bfloat16()
                    run = lambda: gemm.gemm(x, packed, scale, None, 200, g, True, (1 << 40, kernel_id(name)))  # noqa: E731
                    torch.set_num_threads(1)
                    one = run()
                    torch.set_num_threads(2)
                    assert torch.equal(run(), one), (name, m)
    finally:
        torch.set_num_threads(before)


def test_tactics_dispatch_by_token_count():
    """(m_max, kernel) pairs: int8 activations up to 2 tokens, the float kernel past them."""
    packed, scale, _, dense = _weights("int8", 40, 64)
    tactics = (2, kernel_id("portable_int8"), 1 << 40, kernel_id("portable"))
    for m, int8 in ((1, True), (2, True), (3, False), (9, False)):
        x = torch.randn(m, 64)
        got = gemm.gemm(x, packed, scale, None, 40, 0, True, tactics)
        want = (int8_activations(x, 64, ACT_BLOCK) if int8 else x) @ dense.T
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="tactics must be \\(m_max, kernel\\) pairs"):
        gemm.gemm(x, packed, scale, None, 40, 0, True, (4,))
    with pytest.raises(RuntimeError, match="unknown kernel id 99"):
        gemm.gemm(x, packed, scale, None, 40, 0, True, (4, 99))


def test_pack_roundtrip_and_embedding():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        w = (torch.randn(50, 40) * 20).to(dtype)
        packed = gemm.pack(w)
        assert packed.shape == {torch.bfloat16: (4, 32, 32), torch.int8: (4, 16, 64)}.get(dtype, (4, 40, 16))
        assert torch.equal(gemm.unpack(packed, 50, 40), w)
        if dtype != torch.int8:
            ids = torch.tensor([[0, 17, 49], [3, 17, 16]])
            assert torch.equal(gemm.embedding(packed, ids, 50, 40), w[ids])
    q = torch.randint(-8, 8, (20, 64))
    packed, _ = gemm.pack_int4(q, torch.ones(20, 2), 32)
    assert packed.shape == (2, 8, 64)
    lo, hi = (packed.view(torch.int8) << 4) >> 4, packed.view(torch.int8) >> 4  # sign-extended nibbles
    assert torch.equal(lo[0, 0, 4 * 3: 4 * 3 + 4], q[3, 0:4].to(torch.int8))  # column 3, k 0..3
    assert torch.equal(hi[0, 1, 4 * 5: 4 * 5 + 4], q[5, 12:16].to(torch.int8))  # column 5, k 12..15
    w = torch.randn(50, 40)
    packed = gemm.pack(w)
    with pytest.raises(RuntimeError, match=r"token id 50 is outside the vocabulary \[0, 50\)"):
        gemm.embedding(packed, torch.tensor([50]), 50)
    with pytest.raises(RuntimeError, match="ids must be int64"):
        gemm.embedding(packed, torch.tensor([1], dtype=torch.int32), 50)
    with pytest.raises(RuntimeError, match=r"table must be contiguous \[panels, rows, 16\]"):
        gemm.embedding(w, torch.tensor([1]), 50)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embedding_of_a_quantized_table(fmt, dtype):
    """A tied embedding reads its rows out of a quantized lm_head's table: each row dequantized with its
    own scale (int8) or group scales (int4), rounded once into the model's dtype."""
    packed, scale, group_size, dense = _weights(fmt, 50, 128, group_size=64)
    ids = torch.tensor([[0, 17, 49], [3, 17, 16]])
    rows = gemm.embedding(packed, ids, 50, 128, scale, group_size, dtype)
    assert rows.dtype == dtype and torch.equal(rows, dense[ids].to(dtype))
    with pytest.raises(RuntimeError, match=r"token id 50 is outside the vocabulary \[0, 50\)"):
        gemm.embedding(packed, torch.tensor([50]), 50, 128, scale, group_size, dtype)
    with pytest.raises(RuntimeError, match="needs scale"):
        gemm.embedding(packed, ids, 50, 128, scale[:1], group_size, dtype)


@pytest.mark.parametrize("change, message", [
    (dict(x=torch.randn(2, 64, dtype=torch.float64)), "x must be float32, bfloat16 or float16"),
    (dict(x=torch.randn(2, 32)), "x has K = 32 input features"),
    (dict(weight=torch.zeros(3, 64, 8)), r"weight must be contiguous \[panels, rows, 16\]"),
    (dict(weight=torch.zeros(3, 64, 16, dtype=torch.bfloat16)), r"weight must be contiguous \[panels, rows, 32\]"),
    (dict(n=60), "n = 60 does not match 3 weight panels"),
    (dict(weight=torch.zeros(3, 16, 64, dtype=torch.int8)), "Char weights need a scale"),
    (dict(bias=torch.zeros(7)), "bias must have n = 40 values"),
    (dict(weight=torch.zeros(3, 64, 16, dtype=torch.int16)), "weight must be float32, bfloat16"),
])
def test_gemm_bad_input(change, message):
    args = dict(x=torch.randn(2, 64), weight=gemm.pack(torch.randn(40, 64)), scale=None, bias=None, n=40)
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        gemm.gemm(**args)


def test_int4_bad_group_size():
    packed, scale, _, _ = _weights("int4", 32, 64)
    with pytest.raises(RuntimeError, match="group_size must be a power of two >= 32 dividing K = 64"):
        gemm.gemm(torch.randn(1, 64), packed, scale, None, 32, 24)
    with pytest.raises(RuntimeError, match=r"int4 scale must be \[K / group_size, panels \* 16\]"):
        gemm.gemm(torch.randn(1, 64), packed, scale, None, 32, 64)


def test_int4_scales_are_float16_and_checked():
    """Packed int4 scales are float16 (as q4_0's); a float32 one (an older engine's) gives the same
    result; scales float16 cannot hold are refused at packing."""
    packed, scale, g, w = _weights("int4", 32, 64)
    assert scale.dtype == torch.float16
    x = torch.randn(3, 64)
    torch.testing.assert_close(gemm.gemm(x, packed, scale.float(), None, 32, g), gemm.gemm(x, packed, scale, None, 32, g))
    q = torch.zeros(32, 64)
    for bad in (float("inf"), 1e6, float("nan")):
        with pytest.raises(ValueError, match="int4 group scales must fit float16"):
            gemm.pack_int4(q, torch.full((32, 2), bad), 32)


def _run_capped(env, script):
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_default_kernel_without_avx2():
    """ATEN_CPU_CAPABILITY=default: no x86 kernel runs; the portable ones agree with the reference,
    and an engine's AMX/AVX2 tactic falls back to them with a warning instead of an illegal instruction."""
    script = (
        "import torch, sys; sys.path.insert(0, 'tests'); import test_gemm as t\n"
        "from kiln.plugins import cpp, gemm\n"
        "cpp.load(); assert torch.ops.kiln_cpp.cpu_features() == '', torch.ops.kiln_cpp.cpu_features()\n"
        "for fmt in t.FORMATS:\n"
        "    packed, scale, g, dense = t._weights(fmt, 40, 64)\n"
        "    assert list(torch.ops.kiln_cpp.gemm_kernels(packed, torch.bfloat16)) == [1, 5] + ([8] if fmt in ('int8', 'int4') else [])\n"
        "    for m in (1, 9):\n"
        "        x = torch.randn(m, 64)\n"
        "        torch.testing.assert_close(gemm.gemm(x, packed, scale, None, 40, g), x @ dense.T, rtol=1e-5, atol=1e-5)\n"
        "packed, _, _, dense = t._weights('bfloat16', 40, 64)\n"
        "x = torch.randn(3, 64).bfloat16()\n"
        "got = gemm.gemm(x, packed, None, None, 40, 0, True, (1 << 40, t.kernel_id('amx_bf16')))\n"
        "torch.testing.assert_close(got, x.float() @ dense.T, rtol=1e-5, atol=1e-5)\n"
        "print(cpp.kernel_capability())\n")
    proc = _run_capped({"ATEN_CPU_CAPABILITY": "default"}, script)
    assert proc.stdout.strip() == "DEFAULT", proc.stdout
    assert "tactic 'amx_bf16' needs amx_bf16, which this CPU lacks; running 'portable' instead" in proc.stderr, proc.stderr


def test_capped_isa_falls_back_to_avx2():
    """KILN_CPU_ISA=avx2 (an AVX2-only CPU, as far as the kernels go): AVX-512 and AMX tactics run
    the AVX2 kernels of the same arithmetic, int8-activation ones the AVX2 int8 kernel."""
    cpp.load()
    if "avx2" not in torch.ops.kiln_cpp.cpu_features():
        pytest.skip("this CPU lacks avx2")
    script = (
        "import torch, sys; sys.path.insert(0, 'tests'); import test_gemm as t\n"
        "from kiln.plugins import cpp, gemm\n"
        "cpp.load(); assert torch.ops.kiln_cpp.cpu_features() == 'avx2', torch.ops.kiln_cpp.cpu_features()\n"
        "for fmt, kernel in (('bfloat16', 'amx_bf16'), ('bfloat16', 'avx512_bf16'), ('int4', 'avx512_vnni')):\n"
        "    packed, scale, g, dense = t._weights(fmt, 40, 64)\n"
        "    x = torch.randn(5, 64).bfloat16()\n"
        "    got = gemm.gemm(x, packed, scale, None, 40, g, True, (1 << 40, t.kernel_id(kernel)))\n"
        "    xe = t.int8_activations(x, 64, t.act_block(fmt, g)) if kernel == 'avx512_vnni' else x.float()\n"
        "    torch.testing.assert_close(got, xe @ dense.T, rtol=1e-5, atol=1e-5)\n")
    err = _run_capped({"KILN_CPU_ISA": "avx2"}, script).stderr
    assert "running 'avx2' instead" in err and "running 'avx2_int8' instead" in err, err[-2000:]


# --------------------------------------------------------------------------- engines

GEMM_CPP = {"gemm_plugin": "cpp"}
NEW_TOKENS = 16


def _logits_and_tokens(engine_dir):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = LLM(engine_dir).generate(PROMPTS, params)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # tied embeddings read from the packed lm_head; qkv bias
def test_engine_on_gemm_plugin_matches_aten(engine, name):
    """float32 engines: the plugin's GEMMs give ATen's greedy tokens and log-probs."""
    plugin_dir, aten_dir = engine(name, "eager", plugin_config=GEMM_CPP), engine(name, "eager")
    assert json.loads((plugin_dir / "config.json").read_text())["build_config"]["plugin_config"]["gemm_plugin"] == "cpp"
    assert json.loads((aten_dir / "config.json").read_text())["build_config"]["plugin_config"]["gemm_plugin"] == "inline"
    got_tokens, got_lp = _logits_and_tokens(plugin_dir)
    want_tokens, want_lp = _logits_and_tokens(aten_dir)
    assert got_tokens == want_tokens
    for got, want in zip(got_lp, want_lp):
        for g, w in zip(got, want):
            assert g.keys() == w.keys()
            assert all(abs(g[t] - w[t]) < 1e-4 for t in g)


def assert_same_greedy(got, want, want_lp):
    """bf16 rounds differently in different GEMM kernels, and the compiled graph keeps fused sums in
    float32: a random tiny model's near-ties may flip, after which the continuations legitimately differ."""
    for g, w, lps in zip(got, want, want_lp):
        for i, (gt, wt) in enumerate(zip(g, w)):
            if gt != wt:
                assert gt in lps[i] and lps[i][wt] - lps[i][gt] < 0.02, f"token {i}: {gt} for {wt}, not a near tie: {lps[i]}"
                break
    assert sum(g == w for g, w in zip(got, want)) >= len(want) - 1


def test_bf16_aoti_engine_uses_plugin_by_default(engine):
    """A bf16 aoti build puts every GEMM on the plugin (no autotuned copies of the weights: the
    package holds the packed ones only) and generates what the bf16 eager ATen engine does."""
    aoti = engine("llama", "aoti", dtype="bfloat16")
    config = json.loads((aoti / "config.json").read_text())["build_config"]
    assert config["plugin_config"]["gemm_plugin"] == "cpp" and config["max_autotune"] is False
    # and with it (the graph's own loops on one thread) the norms, rope and SwiGLU on kiln_cpp's pool,
    # SwiGLU inside the gate_up GEMM's call
    assert {config["plugin_config"][k] for k in ("rmsnorm_plugin", "rope_plugin", "swiglu_plugin")} == {"cpp"}
    ops = kiln_ops(aoti, "kiln_cpp")
    assert {"gemm", "gemm_swiglu", "rms_norm", "fused_add_rms_norm", "attention"} <= ops  # rope inside attention
    assert "silu_and_mul" not in ops
    eager = engine("llama", "eager", dtype="bfloat16")
    _assert_scores_agree(LLM(aoti), LLM(eager))


def _assert_scores_agree(got_llm, want_llm):
    """got_llm, fed want_llm's greedy continuations (teacher forcing, so that a near tie flipped early
    cannot send the rest of a sequence elsewhere), gives each token about want_llm's log-prob and
    picks it itself but at near ties: bf16 rounds differently in different kernels (the fused SwiGLU
    not at all between the GEMM and the activation)."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    for want in want_llm.generate(PROMPTS, params):
        tokens, lps = want.outputs[0].token_ids, want.outputs[0].logprobs
        scored = got_llm.generate({"prompt_token_ids": want.prompt_token_ids + tokens[:-1]},
                                  SamplingParams(max_tokens=1, prompt_logprobs=5))[0]
        for i, got in enumerate(scored.prompt_logprobs[len(want.prompt_token_ids):]):
            t, w = tokens[i], lps[i]
            assert abs(got[t] - w[t]) < 0.05, f"token {i} ({t}): log-prob {got[t]:.4f}, want {w[t]:.4f}"
            top = max(got, key=got.get)
            assert top == t or (top in w and w[t] - w[top] < 0.02), f"token {i}: picks {top} for {t}: {w}"
