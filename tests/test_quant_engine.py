"""Quantized engines. Oracles: NVIDIA ModelOpt's fake-quantized HF model (tests/modelopt_export.py)
for checkpoints ModelOpt exports, HF transformers for a hand-made RTN int4 one, and the plain-torch
references of kiln/plugins/quant.py for the fast kernels."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import modelopt_export
from conftest import MODELOPT, require
from kiln import LLM, SamplingParams
from kiln.build.builder import build_engine
from kiln.config import BuildConfig, ConfigError
from kiln.plugins import cpu, quant, reference
from kiln.engine.loader import RankEngine
from test_e2e import engine_logits
from tiny_models import PROMPTS

BUILD = dict(max_batch_size=8, max_input_len=128, max_seq_len=192, max_num_tokens=256, tokens_per_block=8)


# -- kernels against their references -----------------------------------------------------------

def _random_case(algo, out, inp, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, inp, generator=g).to(dtype)
    w = torch.randn(out, inp, generator=g) * 0.05
    pqs = (torch.rand(inp, generator=g) + 0.5).to(dtype)
    act = torch.tensor(x.float().abs().max().item() / 300)  # some activations clip
    if algo in ("W4A16", "W4A8"):
        s = w.reshape(out, inp // group, group).abs().amax(-1) / 7
        packed = quant.pack_int4((w / s.repeat_interleave(group, 1)).round().clamp(-8, 7))
        return x, packed, s, pqs, act
    s = w.abs().amax(1) / 127
    return x, (w / s[:, None]).round().clamp(-128, 127).to(torch.int8), s, pqs, act


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out,inp,group", [(96, 64, 32), (64, 128, 64), (256, 128, 128)])
def test_quantized_gemms_match_their_reference(dtype, out, inp, group):
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    close = lambda a, b: torch.testing.assert_close(a.float(), b.float(), **tol)  # noqa: E731

    x, q, s, pqs, act = _random_case("W8A16", out, inp, group, dtype)
    close(quant.w8a16(x, q, s.to(dtype)), quant.ref_w8a16(x, q, s))
    close(quant.w8a8(x, q, (act * s).to(dtype), act, pqs), quant.ref_w8a8(x, q, s, act, pqs))

    x, packed, s, pqs, act = _random_case("W4A16", out, inp, group, dtype)
    weight, sz = quant.int4_for_cpu(packed, s, group, dtype)
    close(quant.w4a16(x, weight, sz, group), quant.ref_w4a16(x, packed, s, group))
    close(quant.w4a16(x, weight, sz, group, pqs), quant.ref_w4a16(x, packed, s, group, pqs))

    s2 = torch.tensor(quant.dequantize_int4(packed, s, group).abs().max().item() / 400)
    w_fp8 = quant.w4a8_weight_fp8(packed, s, s2, group)
    close(quant.fp8(x, w_fp8, act * s2, act, pqs), quant.ref_w4a8(x, packed, s, s2, act, group, pqs))
    ws = torch.tensor(0.001)
    close(quant.fp8(x, w_fp8, act * ws, act), quant.ref_fp8(x, w_fp8, ws, act))


def test_int4_packing_is_modelopts():
    require(*MODELOPT)
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    w = torch.randn(64, 96)
    s = w.reshape(64, 3, 32).abs().amax(-1) / 7
    theirs = pack_int4_in_uint8(w, s, 32).view(torch.int8)
    q = (w / s.repeat_interleave(32, 1)).round().clamp(-8, 7)
    assert torch.equal(quant.pack_int4(q), theirs)
    assert torch.equal(quant.unpack_int4(theirs), q.to(torch.int8))


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_8bit_kv_cache_matches_reference(kv_dtype):
    g = torch.Generator().manual_seed(0)
    H, KH, D, bs = 4, 2, 16, 4
    lens = [5, 9]  # one context request (5 new tokens) and one generation request at length 9
    T = 6
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, KH, KH))
    scale = torch.tensor(0.04)  # int8 range +-5: no clipping of these randn values
    pools = [torch.zeros(1, 2, 8, bs, KH, D, dtype=kv_dtype) for _ in range(2)]
    for pool in pools:  # the generation request's first 8 tokens, already cached
        old = torch.randn(2, 8, KH, D, generator=torch.Generator().manual_seed(1))
        pool[0, :, 4:6] = quant.quantize_to(old, scale, kv_dtype).view(2, 2, bs, KH, D)
    slots = torch.tensor([0, 1, 2, 3, 4, 4 * bs + 8])
    args = (torch.tensor([[0, 1, 2, 3, 4]]), torch.tensor([[0, 1]]), torch.tensor([lens[0]]),
            torch.tensor([5]), torch.tensor([[4, 5, 6]]), torch.tensor([lens[1]]), D ** -0.5, scale)
    reference.kv_cache_write(pools[0], 0, k, v, slots, scale)
    cpu.kv_cache_write(pools[1], 0, k, v, slots, scale)
    assert torch.equal(pools[0].view(torch.int8), pools[1].view(torch.int8))
    expected = reference.paged_attention(q, pools[0], 0, *args)
    torch.testing.assert_close(cpu.paged_attention(q, pools[1], 0, *args), expected, rtol=1e-5, atol=1e-5)
    # Dequantized K/V are what the attention saw: close to the unquantized values.
    k_back = pools[1][0, 0, 0].float() * scale
    err = (k_back[:4] - k[:4]).abs()
    assert (err <= (0.02 + 1e-6 if kv_dtype == torch.int8 else k[:4].abs() / 16 + 1e-3)).all()


# -- engines from ModelOpt checkpoints ----------------------------------------------------------

@pytest.fixture(scope="session")
def modelopt_checkpoint(hf_model, tmp_path_factory):
    """modelopt_checkpoint(algo, kv=None) -> (bf16 checkpoint dir, float32 view of it, oracle)."""
    require(*MODELOPT)
    cache = {}

    def get(algo, kv=None):
        if (algo, kv) not in cache:
            root = tmp_path_factory.mktemp(f"modelopt_{algo}_{kv}")
            ckpt, oracle = modelopt_export.export(hf_model("llama"), root / "bf16", algo, kv)
            cache[algo, kv] = ckpt, modelopt_export.as_float32(ckpt, root / "fp32"), oracle
        return cache[algo, kv]

    return get


def _build(ckpt, out, hf_dir, backend="eager", **overrides):
    return build_engine(ckpt, out, BuildConfig(**{**BUILD, **overrides, "backend": backend}), log=lambda *_: None,
                        tokenizer_dir=hf_dir)


def _prompt_ids(hf_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    return [tok.encode(p) for p in PROMPTS]


def _max_logit_diff(engine_dir, model, sequences):
    runner = RankEngine(engine_dir, max_tokens_in_paged_kv_cache=2048)
    ours = engine_logits(runner, sequences)
    worst = 0.0
    for seq, got in zip(sequences, ours):
        with torch.no_grad():
            worst = max(worst, (got - model(torch.tensor([seq])).logits[0]).abs().max().item())
    return worst


def _weight_bytes(engine_dir):
    """Bytes of the tensors an eager engine holds (its file adds serialization overhead that
    differs by dtype)."""
    with open(engine_dir / "rank0.engine", "rb") as f:
        program = torch.export.load(f)
    tensors = list(program.state_dict.values()) + list(program.constants.values())
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# float32 engines vs the float32 oracle: the same math in another order, except where an activation
# sits on a rounding boundary of its 8-bit grid and flips one step. Tolerances are measured maxima
# (printed) with headroom, and each stays far below the quantization error itself (also asserted).
# Each weight format once, and each 8-bit KV cache once (FP8 here; INT8 with W8A16 in the runtime
# and aoti tests below).
FORMATS = [("W8A16", None, 1e-4), ("W4A16_AWQ", None, 1e-4), ("W8A8_SQ_PER_CHANNEL", None, 2e-2),
           ("W4A8_AWQ", None, 2e-2), ("FP8", "FP8", 2e-2)]


@pytest.mark.parametrize("algo,kv,tol", FORMATS)
def test_modelopt_checkpoint_matches_fake_quant(algo, kv, tol, modelopt_checkpoint, hf_model, engine,
                                                tmp_path, capsys):
    import transformers

    bf16, fp32, oracle = modelopt_checkpoint(algo, kv)
    engine_dir = _build(fp32, tmp_path / "e", hf_model("llama"))
    sequences = _prompt_ids(hf_model("llama"))[:4]
    diff = _max_logit_diff(engine_dir, oracle, sequences)
    plain = transformers.AutoModelForCausalLM.from_pretrained(hf_model("llama"), torch_dtype=torch.float32).eval()
    quant_error = _max_logit_diff(engine_dir, plain, sequences)
    with capsys.disabled():
        print(f"\n[{algo}/kv {kv}] max |logit - ModelOpt fake-quant| = {diff:.2e} "
              f"(vs unquantized model: {quant_error:.2e})")
    assert diff < tol and diff < 0.2 * quant_error

    # Sizes against the unquantized float32 engine of the same model.
    config = json.loads((engine_dir / "config.json").read_text())
    plain_engine = RankEngine(engine("llama", "eager"), max_tokens_in_paged_kv_cache=64)
    ours = RankEngine(engine_dir, max_tokens_in_paged_kv_cache=64)
    linear_params = 2 * (64 * 128 + 64 * 64 + 3 * 64 * 128)
    untied_lm_head = 384 * 64 * 4  # ModelOpt unties the tiny model's lm_head; Kiln's converter does not
    bits = 4 if "W4A16" in algo else 8  # W4A8 runs on fp8 weights (kiln/plugins/quant.py)
    saved = _weight_bytes(engine("llama", "eager")) + untied_lm_head - _weight_bytes(engine_dir)
    assert saved > 0.95 * linear_params * (4 - bits / 8)
    if kv:
        assert ours.kv_cache.dtype == {"FP8": torch.float8_e4m3fn, "INT8": torch.int8}[kv]
        assert config["build_config"]["kv_cache_dtype"] == str(ours.kv_cache.dtype).removeprefix("torch.")
        assert ours.bytes_per_block * 4 == plain_engine.bytes_per_block  # 1 byte per value, not 4
    else:
        assert ours.bytes_per_block == plain_engine.bytes_per_block


def test_runtime_generates_from_quantized_bf16_engine(modelopt_checkpoint, hf_model, tmp_path):
    """The full runtime (paged KV, in-flight batching, sampling) on a bf16 W8A16 engine with an INT8
    KV cache: greedy outputs start as the oracle's, and seeded sampling repeats."""
    bf16, _, oracle = modelopt_checkpoint("W8A16", "INT8")
    engine_dir = _build(bf16, tmp_path / "e", hf_model("llama"))
    llm = LLM(engine_dir, max_tokens_in_paged_kv_cache=1024)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    agree = 0
    for out in greedy:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            want = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                   pad_token_id=2)[0, ids.shape[1]:].tolist()
        agree += out.outputs[0].token_ids[:4] == want[:4]
    assert agree >= len(PROMPTS) - 1  # bf16 vs float32 may break one near-tie
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert first == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert all(len(t) == 10 for t in first)


# With an 8-bit KV cache the aoti engine reads the int8 pages with the C++ attention, the eager one
# dequantizes them inline (fp8 pages: tests/test_cpp_attention.py).
@pytest.mark.parametrize("algo,kv", [("W4A16_AWQ", None), ("W8A8_SQ_PER_CHANNEL", None), ("W8A16", "INT8")])
def test_aoti_quantized_engine_matches_eager(algo, kv, modelopt_checkpoint, hf_model, tmp_path, capsys):
    bf16, _, oracle = modelopt_checkpoint(algo, kv)
    hf_dir = hf_model("llama")
    eager = _build(bf16, tmp_path / "eager", hf_dir)
    aoti = _build(bf16, tmp_path / "aoti", hf_dir, backend="aoti")
    build_config = json.loads((aoti / "config.json").read_text())["build_config"]
    assert build_config["plugin_config"]["gpt_attention_plugin"] == "cpp"
    if kv:
        assert build_config["kv_cache_dtype"] == "int8"
    sequences = _prompt_ids(hf_dir)[:3]
    a = engine_logits(RankEngine(aoti, max_tokens_in_paged_kv_cache=1024), sequences)
    e = engine_logits(RankEngine(eager, max_tokens_in_paged_kv_cache=1024), sequences)
    diff = max((x - y).abs().max().item() for x, y in zip(a, e))
    vs_oracle = _max_logit_diff(aoti, oracle, sequences)
    with capsys.disabled():
        print(f"\n[{algo}/kv {kv}/aoti bf16] max |aoti - eager| = {diff:.2e}, vs ModelOpt fake-quant = {vs_oracle:.2e}")
    # bf16 activations carry about 3 significant digits; compiled and eager code round differently
    # (fused elementwise ops), and with 8-bit activations a difference can flip a rounding step.
    # Measured: W4A16 0.04, SmoothQuant 0.15-0.17, W8A16 with an INT8 KV cache 0.05 aoti vs eager,
    # against quantization errors near 1.
    assert diff < 0.25 and vs_oracle < 0.25


# -- a hand-made RTN int4 checkpoint (W4A16: AWQ's layout without pre-quant scales) ---------------

# kernels "triton": the GPU op set's int4 GEMM (kiln/plugins/gpu/gemm.py) in Triton's interpreter
@pytest.mark.parametrize("kernels,group", [("cpu", 32), ("triton", 64)])
def test_rtn_w4a16_checkpoint_matches_hf_with_dequantized_weights(kernels, group, checkpoint, hf_model, tmp_path,
                                                                 capsys):
    import transformers

    src = checkpoint("llama")
    ckpt = tmp_path / "rtn"
    shutil.copytree(src, ckpt)
    weights = load_file(src / "rank0.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_model("llama"), torch_dtype=torch.float32).eval()
    for key in [k for k in weights if k.endswith(tuple(f"{n}.weight" for n in modelopt_export.LINEARS))]:
        w = weights.pop(key)
        s = w.reshape(w.shape[0], -1, group).abs().amax(-1) / 7
        q = (w / s.repeat_interleave(group, 1)).round().clamp(-8, 7)
        weights[key] = quant.pack_int4(q)
        weights[key.replace(".weight", ".weights_scaling_factor")] = s
        layer, name = int(key.split(".")[2]), key.split(".", 3)[3].rsplit(".", 1)[0]
        theirs = [hf.model.layers[layer].get_submodule(n) for n in modelopt_export.LINEARS[name]]
        deq = (q * s.repeat_interleave(group, 1)).split([t.weight.shape[0] for t in theirs])
        with torch.no_grad():
            for t, d in zip(theirs, deq):
                t.weight.copy_(d)
    save_file(weights, ckpt / "rank0.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization"].update(quant_algo="W4A16", group_size=group)
    (ckpt / "config.json").write_text(json.dumps(config))
    engine_dir = _build(ckpt, tmp_path / "e", None, kernels=kernels)
    diff = _max_logit_diff(engine_dir, hf, _prompt_ids(hf_model("llama"))[:3])
    with capsys.disabled():
        print(f"\n[W4A16 RTN, {kernels} kernels, group {group}] max |logit - HF with dequantized weights| = {diff:.2e}")
    assert diff < 1e-4


# -- bad input ----------------------------------------------------------------------------------

def _edited_copy(ckpt, dest, config_edit=None, tensor_edit=None):
    dest.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    weights = load_file(ckpt / "rank0.safetensors")
    if tensor_edit:
        tensor_edit(weights)
    save_file(weights, dest / "rank0.safetensors")
    return dest


def test_bad_quantized_checkpoints_get_one_line_errors(modelopt_checkpoint, tmp_path):
    bf16, _, _ = modelopt_checkpoint("W4A16_AWQ")
    nvfp4 = _edited_copy(bf16, tmp_path / "nvfp4", config_edit=lambda c: c["quantization"].update(quant_algo="NVFP4"))
    with pytest.raises(ConfigError, match=r"quant_algo 'NVFP4' is not supported; expected one of W8A16, .*W4A8_AWQ"):
        _build(nvfp4, tmp_path / "e1", None)

    key = "transformer.layers.1.mlp.proj.weights_scaling_factor"
    bad = _edited_copy(bf16, tmp_path / "shape", tensor_edit=lambda w: w.update({key: w[key][:, :1].clone()}))
    with pytest.raises(ConfigError, match=rf"tensor {key} has shape \(64, 1\), expected \(64, 4\) "
                                          r"\(quant_algo W4A16_AWQ\)"):
        _build(bad, tmp_path / "e2", None)

    key = "transformer.layers.0.attention.dense.weight"
    bad = _edited_copy(bf16, tmp_path / "dtype", tensor_edit=lambda w: w.update({key: w[key].float()}))
    with pytest.raises(ConfigError, match=rf"tensor {key} has dtype torch.float32, expected int8 holding two int4"):
        _build(bad, tmp_path / "e3", None)
    assert not (tmp_path / "e1").exists() and not (tmp_path / "e2").exists()

