"""The C++ paged-attention plugin (torch.ops.kiln_cpp.paged_attention, kiln/plugins/csrc) held to the
plain-torch reference (the spec), traced by torch.export, compiled into AOTInductor packages that run
without the Python that defined kiln's ops, and end to end in an engine against inline attention.

The library is built on first use into the cache (kiln/plugins/cpp.py); the first test pays for it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
import zlib

import pytest
import torch
from torch.export import Dim

from kiln import LLM, SamplingParams
from kiln.plugins import cpp, quant, reference
from test_plugins import BF16_TOL, F32_TOL, HEADS, STEPS, _args, _dense_attention, _make_step
from tiny_models import PROMPTS

NAMES = ("q", "kv_cache", "layer", "ctx_token_index", "ctx_block_tables", "ctx_context_lens", "gen_token_index",
         "gen_block_tables", "gen_context_lens", "scale")


@pytest.fixture(scope="module")
def op():
    return cpp.paged_attention_op()


def _step(step, block_size, heads, head_dim, **kw):
    kv_heads, num_heads = HEADS[heads]
    seed = zlib.crc32(f"cpp/{step}/{block_size}/{heads}/{head_dim}".encode())
    return _make_step(STEPS[step], layers=2, kv_heads=kv_heads, heads=num_heads, head_dim=head_dim,
                      block_size=block_size, seed=seed, extra_q_pad=3, extra_block_pad=2, **kw)


def _check(actual, expected, dtype, msg):
    assert actual.dtype == dtype and actual.shape == expected.shape, msg
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(actual.float(), expected.float(), **tol, msg=lambda m: f"{msg}: {m}")


# STEPS (tests/test_plugins.py) hold context lengths 1, 17, 33, 128, 129 and 1000, prefill chunks that
# start past cached tokens (q_len < context_len) and chunks longer than one work tile, mixed with
# decodes in one flat batch, plus steps with no generation (Sg = 0) and no context requests (Sc = 0).
@pytest.mark.parametrize("heads", HEADS, ids=list(HEADS))  # MHA, GQA 3, GQA 8, MQA
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("step", STEPS, ids=list(STEPS))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_matches_reference(op, step, block_size, heads, head_dim):
    inputs, seqs = _step(step, block_size, heads, head_dim)
    args = _args(inputs)
    expected = reference.paged_attention(*args)
    cache_before = inputs["kv_cache"].clone()
    _check(op(*args), expected, torch.float32, "float32")
    assert torch.equal(inputs["kv_cache"], cache_before)  # attention only reads the cache
    if head_dim == 16:  # the reference against an oracle that knows nothing of pages (as in test_plugins)
        torch.testing.assert_close(expected, _dense_attention(inputs["q"], seqs, inputs["scale"]), **F32_TOL)

    # bfloat16 q and cache, against the float32 reference on the same rounded values.
    q16, cache16 = inputs["q"].bfloat16(), inputs["kv_cache"].bfloat16()
    expected16 = reference.paged_attention(q16.float(), cache16.float(), *args[2:])
    _check(op(q16, cache16, *args[2:]), expected16, torch.bfloat16, "bfloat16")


@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (128, 64), (80, 16), (46, 7), (64, 256)])
def test_bf16_context_kernel(op, tmp_path, head_dim, block_size):
    """Context tiles of a bf16 q over a bf16 pool run on bf16 dot products where the CPU has
    AVX512_BF16 (csrc/attention_bf16.cpp; on AMX tiles too where it has AMX and head_dim is a multiple
    of 32), on vdpbf16ps alone with KILN_CPU_ISA=avx512_bf16, and on the float kernel with
    KILN_CPU_ISA=avx512: all within bf16 tolerance of the reference. The float kernel's results differ
    (the bf16 ones round P to bf16), which shows which kernel ran. Prefills long and short, one past
    cached tokens, GQA 3, a head_dim off 32, a page of an odd size and one longer than a softmax chunk."""
    from safetensors.torch import load_file, save_file

    cpp.load()
    if "avx512_bf16" not in torch.ops.kiln_cpp.cpu_features().split(","):
        pytest.skip("this CPU (or KILN_CPU_ISA / ATEN_CPU_CAPABILITY) lacks avx512_bf16")
    inputs, _ = _make_step([("ctx", 300, 300), ("gen", 40, 1), ("ctx", 200, 77), ("ctx", 20, 20)], layers=1,
                           kv_heads=3, heads=9, head_dim=head_dim, block_size=block_size, seed=head_dim)
    args = list(_args(inputs))
    args[0], args[1] = args[0].bfloat16(), args[1].bfloat16()
    expected = reference.paged_attention(args[0].float(), args[1].float(), *args[2:])
    ours = op(*args)
    _check(ours, expected, torch.bfloat16, "bf16 kernel")

    tensors = {str(i): a.contiguous() for i, a in enumerate(args) if torch.is_tensor(a)}
    save_file(tensors, tmp_path / "args.safetensors")
    script = textwrap.dedent(f"""
        import torch
        from safetensors.torch import load_file, save_file
        from kiln.plugins import cpp
        cpp.load()
        assert "amx_bf16" not in torch.ops.kiln_cpp.cpu_features()
        t = load_file({str(tmp_path / "args.safetensors")!r})
        args = [t[str(i)] if str(i) in t else a for i, a in enumerate({[None if torch.is_tensor(a) else a
                                                                          for a in args]!r})]
        save_file({{"out": torch.ops.kiln_cpp.paged_attention(*args)}}, {str(tmp_path / "out.safetensors")!r})
    """)
    def run(isa):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "KILN_CPU_ISA": isa})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return load_file(tmp_path / "out.safetensors")["out"]

    floats = run("avx512")
    _check(floats, expected, torch.bfloat16, "float kernel")
    assert not torch.equal(ours, floats)
    if "amx_bf16" in torch.ops.kiln_cpp.cpu_features().split(","):
        _check(run("avx512_bf16"), expected, torch.bfloat16, "vdpbf16ps kernel without AMX")


@pytest.mark.parametrize("head_dim", [8, 12, 40, 72])  # tails of the 8-wide (AVX2) / 16-wide (AVX-512) vectors
def test_head_dims_off_the_vector_width(op, head_dim):
    inputs, _ = _step("mixed", 16, "gqa3", head_dim)
    args = _args(inputs)
    _check(op(*args), reference.paged_attention(*args), torch.float32, f"head_dim {head_dim}")


def test_float16_and_mixed_dtypes(op):
    inputs, _ = _step("mixed", 32, "gqa3", 64)
    args = _args(inputs)
    q, cache = inputs["q"], inputs["kv_cache"]
    q16, cache16 = q.half(), cache.half()
    expected = reference.paged_attention(q16.float(), cache16.float(), *args[2:])
    _check(op(q16, cache16, *args[2:]), expected, torch.float16, "float16")
    # A float32 q over a bf16 cache (a cache kept narrower than the model): output in q's dtype.
    cache_bf16 = cache.bfloat16()
    expected = reference.paged_attention(q, cache_bf16.float(), *args[2:])
    _check(op(q, cache_bf16, *args[2:]), expected, torch.float32, "float32 q, bfloat16 cache")


def _8bit_pool(cache, kv_dtype):
    """cache as an 8-bit pool holds it (kiln/plugins/reference.py, kv_cache_write): the elements and
    the static scale that maps the largest value to the format's largest."""
    kv_scale = cache.abs().max() / (127 if kv_dtype == torch.int8 else quant.FP8_MAX)
    return quant.quantize_to(cache, kv_scale, kv_dtype), kv_scale


# An INT8 / FP8 KV cache: the op reads the 8-bit elements in place and applies the layer's scale,
# against the reference on the same elements (dequantized in float32). Both phases, the decode path
# (head_dim 64) and the general one (16), GQA and MHA, flash-decoding partitions (gen_only's
# 1000-token decodes over 4 threads).
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("heads", ["mha", "gqa3", "gqa8"])
@pytest.mark.parametrize("step", STEPS, ids=list(STEPS))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_8bit_kv_cache_matches_reference(op, kv_dtype, step, heads, head_dim):
    inputs, _ = _step(step, 16, heads, head_dim)
    q, cache, *rest = _args(inputs)
    pool, kv_scale = _8bit_pool(cache, kv_dtype)
    expected = reference.paged_attention(q, pool, *rest, kv_scale=kv_scale)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        _check(op(q, pool, *rest, kv_scale), expected, torch.float32, f"{kv_dtype} pool")
    finally:
        torch.set_num_threads(before)
    expected16 = reference.paged_attention(q.bfloat16().float(), pool, *rest, kv_scale=kv_scale)
    _check(op(q.bfloat16(), pool, *rest, kv_scale), expected16, torch.bfloat16, f"bfloat16 q, {kv_dtype} pool")


def test_every_fp8_value_widens_exactly(op):
    """Each of the 254 finite fp8 e4m3 values (subnormals included) as the only key and value of a
    decode: the output is that value times the scale."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    values = values[values.float().isfinite()]
    n = len(values)
    # n one-token sequences, one KV head of head_dim 16 holding the value in every lane.
    pool = values.view(n, 1, 1, 1).expand(n, 1, 1, 16).reshape(1, 1, n, 1, 1, 16)
    pool = torch.cat([pool, pool], dim=1)
    q = torch.ones(n, 1, 16)
    out = op(q, pool, 0, torch.empty(0, 1, dtype=torch.int64), torch.empty(0, 1, dtype=torch.int32),
             torch.empty(0, dtype=torch.int32), torch.arange(n), torch.arange(n, dtype=torch.int32).view(n, 1),
             torch.ones(n, dtype=torch.int32), 0.25, torch.tensor(0.5))
    assert torch.equal(out, (values.float() * 0.5).view(n, 1, 1).expand(n, 1, 16))


def test_strided_q_untouched_tokens_and_int64_metadata(op):
    """q as the model produces it (a view into the fused QKV projection), tokens that belong to no
    request (left zero), and int64 tables/lengths (converted, not rejected)."""
    inputs, _ = _step("mixed", 16, "gqa3", 16)
    q = inputs["q"]
    T, H, D = q.shape
    qkv = torch.randn(T + 2, (H + 4) * D)
    qkv[:T, : H * D] = q.flatten(1)
    strided = qkv[:, : H * D].view(T + 2, H, D)  # rows T, T+1: in neither phase
    assert not strided.is_contiguous()
    args = list(_args({**inputs, "q": strided}))
    for i in (4, 5, 7, 8):
        args[i] = args[i].long()
    out = op(*args)
    expected = reference.paged_attention(*args)
    _check(out, expected, torch.float32, "strided q")
    assert out.is_contiguous() and torch.equal(out[T:], torch.zeros(2, H, D))


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_decodes_split_over_threads(op, threads, dtype):
    """A decode batch too small to keep the threads busy splits its long sequences into partitions
    of pages (flash-decoding) and combines them: the same result as one pass, and repeatable."""
    inputs, _ = _make_step([("gen", 2500, 1), ("gen", 1100, 1), ("gen", 40, 1)], layers=1, kv_heads=2, heads=6,
                           head_dim=64, block_size=16, seed=threads)
    args = list(_args(inputs))
    args[0], args[1] = args[0].to(dtype), args[1].to(dtype)
    expected = reference.paged_attention(args[0].float(), args[1].float(), *args[2:])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = op(*args)
        assert torch.equal(op(*args), out)  # dynamic scheduling never changes a row's arithmetic
    finally:
        torch.set_num_threads(before)
    _check(out, expected, dtype, f"{threads} threads")


@pytest.mark.parametrize("bad,message", [
    (dict(layer=2), "layer 2 is outside the cache's 2 layers"),
    (dict(gen_block_tables=lambda t: t.fill_(-1)), "outside the pool's"),
    (dict(gen_context_lens=lambda t: t.fill_(0)), "expected >= 1"),
    (dict(ctx_context_lens=lambda t: t.fill_(1)), "new tokens but context length"),
    (dict(ctx_token_index=lambda t: t.fill_(1000)), "is outside the step's"),
    (dict(gen_context_lens=lambda t: t.fill_(10 ** 6)), "but its block table has"),
    (dict(q=lambda t: t[:, :5]), "must be a multiple of kv_heads"),
    (dict(q=lambda t: t.double()), "q must be float32, bfloat16 or float16"),
    (dict(gen_block_tables=lambda t: t.float()), "gen_block_tables must be int32 or int64, got Float"),
    (dict(kv_cache=lambda t: t.to(torch.int8)), "an int8 or float8_e4m3fn kv_cache needs kv_scale"),
    (dict(kv_cache=lambda t: t.to(torch.int16)), "kv_cache must be float32, bfloat16, float16, int8 or "
                                                  "float8_e4m3fn, got Short"),
    (dict(kv_scale=torch.tensor([0.1, 0.2])), "kv_scale must be one floating-point value"),
    (dict(kv_scale=torch.tensor(0.0)), "kv_scale must be positive and finite, got 0"),
])
def test_bad_steps_raise(op, bad, message):
    inputs, _ = _step("mixed", 16, "gqa3", 16)
    inputs = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in inputs.items()}
    for k, change in bad.items():
        inputs[k] = change(inputs[k]) if callable(change) else change
    with pytest.raises(RuntimeError, match=message):
        op(*_args(inputs), *([inputs["kv_scale"]] if "kv_scale" in inputs else []))


def test_opcheck(op):
    inputs, _ = _make_step([("ctx", 9, 3), ("gen", 6, 1), ("ctx", 2, 2)], layers=2, kv_heads=2, heads=4,
                           head_dim=8, block_size=4, seed=7)
    torch.library.opcheck(op, _args(inputs))
    q, cache, *rest = _args(inputs)
    pool, kv_scale = _8bit_pool(cache, torch.int8)
    torch.library.opcheck(op, (q, pool, *rest, kv_scale))
    assert torch.Tag.pt2_compliant_tag in op.default.tags


def test_default_kernel(tmp_path):
    """The portable build of the kernel (what CPUs without AVX2 run), forced as ATen's own is."""
    script = textwrap.dedent("""
        import torch
        from kiln.plugins import cpp, quant, reference
        from test_plugins import _make_step, _args, STEPS
        op = cpp.paged_attention_op()
        assert cpp.kernel_capability() == "DEFAULT", cpp.kernel_capability()
        for kv_heads, heads, head_dim, bs in [(2, 6, 16, 16), (1, 8, 12, 32), (2, 2, 64, 16)]:
            for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn):
                inputs, _ = _make_step(STEPS["mixed"], layers=2, kv_heads=kv_heads, heads=heads, head_dim=head_dim,
                                       block_size=bs, seed=3)
                args = list(_args(inputs))
                tol = dict(atol=1e-5, rtol=1e-5)
                if dtype.itemsize == 1:  # an 8-bit pool and its scale
                    kv_scale = args[1].abs().max() / (127 if dtype == torch.int8 else quant.FP8_MAX)
                    args[1] = quant.quantize_to(args[1], kv_scale, dtype)
                    expected = reference.paged_attention(*args, kv_scale=kv_scale)
                    args.append(kv_scale)
                else:
                    args[0], args[1] = args[0].to(dtype), args[1].to(dtype)
                    expected = reference.paged_attention(args[0].float(), args[1].float(), *args[2:])
                    if dtype == torch.bfloat16:
                        tol = dict(atol=1e-2, rtol=1.6e-2)
                torch.testing.assert_close(op(*args).float(), expected, **tol)
        print("ok")
    """)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_missing_compiler_is_a_clear_error(tmp_path):
    """A machine that has never built the library and has no compiler: one line saying so."""
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path), "CXX": "no-such-c++-compiler"}
    script = "from kiln.plugins import cpp\ncpp.load()"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kiln.plugins.cpp.PluginBuildError:") and "'no-such-c++-compiler' is not on PATH" in last


# --------------------------------------------------------------------------- export and AOTInductor


class _Attention(torch.nn.Module):
    """The op between two traced ops, as a model calls it."""

    def forward(self, q, kv_cache, ctx_token_index, ctx_block_tables, ctx_context_lens, gen_token_index,
                gen_block_tables, gen_context_lens):
        out = torch.ops.kiln_cpp.paged_attention(q * 2, kv_cache, 1, ctx_token_index, ctx_block_tables,
                                                 ctx_context_lens, gen_token_index, gen_block_tables,
                                                 gen_context_lens, 0.125)
        return out + 1


def _tiny_step(requests, seed):
    inputs, _ = _make_step(requests, layers=2, kv_heads=2, heads=4, head_dim=16, block_size=4, seed=seed)
    return {k: v for k, v in inputs.items() if k not in ("layer", "scale")}


def _tiny_expected(step):
    return reference.paged_attention(step["q"] * 2, step["kv_cache"], 1, *(step[k] for k in NAMES[3:9]), 0.125) + 1


def _export_tiny():
    example = _tiny_step([("ctx", 9, 3), ("gen", 6, 1), ("ctx", 7, 4), ("gen", 20, 1), ("gen", 3, 1)], seed=11)
    T, Q = Dim("T", min=1, max=64), Dim("Q", min=1, max=64)
    Sc, Sg = Dim("Sc", min=0, max=8), Dim("Sg", min=0, max=8)
    MBc, MBg, NB = Dim("MBc", min=1, max=16), Dim("MBg", min=1, max=16), Dim("NB", min=2, max=1 << 20)
    shapes = dict(q={0: T}, kv_cache={2: NB}, ctx_token_index={0: Sc, 1: Q}, ctx_block_tables={0: Sc, 1: MBc},
                  ctx_context_lens={0: Sc}, gen_token_index={0: Sg}, gen_block_tables={0: Sg, 1: MBg},
                  gen_context_lens={0: Sg})
    return torch.export.export(_Attention(), (), example, dynamic_shapes=shapes, strict=False)


# Other sizes than the example's, and steps without one of the phases.
OTHER_STEPS = [[("gen", 13, 1), ("ctx", 30, 30), ("gen", 1, 1)], [("ctx", 5, 2)], [("gen", 40, 1), ("gen", 2, 1)]]


def test_export_with_dynamic_shapes(op):
    program = _export_tiny()
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert torch.ops.kiln_cpp.paged_attention.default in targets
    module = program.module()
    for i, requests in enumerate(OTHER_STEPS):
        step = _tiny_step(requests, seed=20 + i)
        torch.testing.assert_close(module(**step), _tiny_expected(step), **F32_TOL)


@pytest.fixture(scope="module")
def tiny_package(op, tmp_path_factory):
    path = tmp_path_factory.mktemp("aoti") / "tiny.pt2"
    torch._inductor.aoti_compile_and_package(_export_tiny(), package_path=str(path))
    return path


def test_aoti_package_runs_without_kilns_python(tiny_package, tmp_path):
    """The package calls the op through the dispatcher: a process that never imports kiln (so no
    Python defines any op) and only loads the library runs it; without the library it cannot."""
    from safetensors.torch import save_file

    steps = {f"{i}.{k}": v.contiguous() for i, r in enumerate(OTHER_STEPS) for k, v in _tiny_step(r, 30 + i).items()}
    save_file(steps, tmp_path / "steps.safetensors")
    script = textwrap.dedent(f"""
        import sys, torch
        from safetensors.torch import load_file, save_file
        if sys.argv[1] == "with-library":
            torch.ops.load_library({str(cpp.library_path())!r})
        runner = torch._inductor.aoti_load_package({str(tiny_package)!r})
        steps = load_file({str(tmp_path / "steps.safetensors")!r})
        out = {{}}
        for i in range({len(OTHER_STEPS)}):
            out[str(i)] = runner(**{{k.split(".", 1)[1]: v for k, v in steps.items() if k.startswith(f"{{i}}.")}})
        assert not any(m == "kiln" or m.startswith("kiln.") for m in sys.modules)
        save_file(out, {str(tmp_path / "out.safetensors")!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script, "with-library"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    out = load_file(tmp_path / "out.safetensors")
    for i, requests in enumerate(OTHER_STEPS):
        torch.testing.assert_close(out[str(i)], _tiny_expected(_tiny_step(requests, 30 + i)), **F32_TOL)

    proc = subprocess.run([sys.executable, "-c", script, "without"], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "kiln_cpp" in proc.stderr


# --------------------------------------------------------------------------- end to end

# float32: the GEMMs stay ATen's, and with them the elementwise ops inline.
CPP_PLUGINS = {"gpt_attention_plugin": "cpp", "gemm_plugin": "inline", "rmsnorm_plugin": "inline",
               "rope_plugin": "inline", "swiglu_plugin": "inline"}
NEW_TOKENS = 24


@pytest.mark.parametrize("backend", ["aoti", "eager"])
def test_engine_greedy_matches_inline_attention(engine, backend):
    """The tiny Llama built with the C++ attention plugin (aoti's default) generates the inline-attention
    engine's greedy tokens (GQA, prompts of different lengths batched together, 24 decode steps)."""
    inline_dir = engine("llama", "eager")  # eager traces attention inline by default
    cpp_dir = engine("llama", "aoti") if backend == "aoti" else engine("llama", backend, plugin_config=CPP_PLUGINS)
    assert json.loads((cpp_dir / "config.json").read_text())["build_config"]["plugin_config"] == CPP_PLUGINS
    assert json.loads((inline_dir / "config.json").read_text())["build_config"]["plugin_config"] == \
        {**CPP_PLUGINS, "gpt_attention_plugin": "inline"}
    with zipfile.ZipFile(cpp_dir / "rank0.engine") as z:  # the graph calls the C++ op; the inline one does not
        assert any(b"kiln_cpp::attention" in z.read(n) or b"kiln_cpp.attention" in z.read(n)
                   for n in z.namelist())
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(inline_dir).generate(PROMPTS, params)]
    got = [o.outputs[0].token_ids for o in LLM(cpp_dir).generate(PROMPTS, params)]
    assert all(len(t) == NEW_TOKENS for t in got)
    assert got == expected


def _slot_mapping(inputs, block_size):
    """Each new token's pool slot, from the step's block tables (its position: the last q_len of its
    sequence)."""
    T = inputs["q"].shape[0]
    slots = torch.empty(T, dtype=torch.int64)
    for tokens, table, length in zip(inputs["ctx_token_index"], inputs["ctx_block_tables"], inputs["ctx_context_lens"]):
        tokens = tokens[tokens >= 0]
        pos = torch.arange(int(length) - len(tokens), int(length))
        slots[tokens] = table.long()[pos // block_size] * block_size + pos % block_size
    for token, table, length in zip(inputs["gen_token_index"], inputs["gen_block_tables"], inputs["gen_context_lens"]):
        pos = int(length) - 1
        slots[token] = int(table[pos // block_size]) * block_size + pos % block_size
    return slots


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("norms,rotary_dims", [(False, 16), (True, 8)])
def test_fused_attention_is_the_separate_ops(dtype, cache_dtype, norms, rotary_dims):
    """kiln_cpp::attention = rms_norm per head (q/k norms), rotary_embedding, the KV write and
    paged_attention: the same output and pool, bit for bit; rotary_dims 8 of head_dim 16 rotates part."""
    from kiln.plugins import cpu

    ops = torch.ops.kiln_cpp
    cpp.load()
    inputs, _ = _step("mixed", 16, "gqa3", 16)
    g = torch.Generator().manual_seed(3)
    (KH, H), D, T, eps = HEADS["gqa3"], 16, inputs["q"].shape[0], 1e-6
    qkv = torch.randn(T, (H + 2 * KH) * D, generator=g).to(dtype)
    angles = torch.randn(T, rotary_dims // 2, generator=g) * 3
    cos, sin = angles.cos(), angles.sin()
    q_norm, k_norm = ((torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(2)) if norms else (None, None)
    slots = _slot_mapping(inputs, 16)
    step = [inputs[k] for k in NAMES[3:9]]
    layer, cache = inputs["layer"], inputs["kv_cache"].to(cache_dtype)

    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, KH * D, KH * D], dim=-1))
    if norms:
        q, k = ops.rms_norm(q, q_norm, eps), ops.rms_norm(k, k_norm, eps)
    q, k = ops.rotary_embedding(q, k, cos, sin)
    want_cache = cache.clone()
    cpu.kv_cache_write(want_cache, layer, k, v, slots)
    want = ops.paged_attention(q, want_cache, layer, *step, inputs["scale"])

    got_cache = cache.clone()
    got = ops.attention(qkv, cos, sin, got_cache, layer, slots, *step, H, inputs["scale"], q_norm, k_norm, eps)
    assert torch.equal(got_cache, want_cache)
    assert got.dtype == dtype and torch.equal(got, want)


def test_fused_attention_errors():
    cpp.load()
    inputs, _ = _step("gen_only", 16, "mha", 16)
    (KH, H), D, T = HEADS["mha"], 16, inputs["q"].shape[0]
    qkv, cos = torch.randn(T, (H + 2 * KH) * D), torch.ones(T, D // 2)
    step = [inputs[k] for k in NAMES[3:9]]
    slots = _slot_mapping(inputs, 16)
    attention = torch.ops.kiln_cpp.attention
    with pytest.raises(RuntimeError, match="qkv must be"):
        attention(qkv[:, :-1], cos, cos, inputs["kv_cache"], 1, slots, *step, H, 0.25)
    with pytest.raises(RuntimeError, match="8-bit pools take kv_cache_write"):
        attention(qkv, cos, cos, inputs["kv_cache"].to(torch.int8), 1, slots, *step, H, 0.25)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = -1 is outside"):
        attention(qkv, cos, cos, inputs["kv_cache"], 1, slots * 0 - 1, *step, H, 0.25)
