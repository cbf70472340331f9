"""Pre-quantized HF checkpoints (GPTQ, AWQ, compressed-tensors, ModelOpt's HF export, bitsandbytes),
converted without re-quantizing. The fixtures in tests/data/prequant were made by each format's own
producer (the make_*.py scripts there say which, and how); the oracle is HF transformers running the
weights as that producer's own code dequantizes them (<name>.dequantized.safetensors), with the
activations of FP8 formats fake-quantized as the checkpoint says (its static input scales, or per token).
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import TEST_BUILD
from kiln import LLM, SamplingParams
from kiln.build.builder import build_engine
from kiln.config import BuildConfig
from kiln.convert.cli import convert_checkpoint
from kiln.engine.loader import RankEngine
from kiln.plugins.quant import FP8, FP8_MAX
from test_e2e import engine_logits
from test_vllm_commands import env  # noqa: F401 (a fixture: an engine cache of the test's own)

DATA = Path(__file__).parent / "data" / "prequant"
NEW_TOKENS = 12
# name -> (max, median) over positions of max |Δlogit| allowed against the oracle in float32 (measured
# maxima, printed, with headroom). The compressed-tensors int oracles were dequantized in bfloat16, Kiln
# in float32 (their weights agree to bf16 rounding: test_converted_weights_...). With FP8 activations an
# activation on a rounding boundary of the 8-bit grid may flip one step, and the flip runs on through
# the later positions: there the median stays at float rounding and the max is a flip's.
EXACT, BF16_ORACLE, FP8_ACTIVATIONS = (1e-4, 1e-4), (5e-2, 3e-2), (0.5, 1e-4)
CASES = {
    "gptq_llama_g128_desc": EXACT,  # transformers' GPTQConfig(bits=4, group_size=128, desc_act=True)
    "gptq_qwen2_g32_asym": EXACT,
    "gptq_llama_8bit": EXACT,
    "gptq_qwen2_g64_v2": EXACT,
    "awq_llama_gemm": EXACT,  # AutoAWQ {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}
    "awq_qwen2_gemv": (5e-3, 3e-3),  # its oracle: AutoAWQ's fake-quantized float16 weights
    "ct_llama_w4a16": BF16_ORACLE,
    "ct_qwen2_w4a16_asym": (5e-3, 3e-3),  # a float16 oracle
    "ct_llama_w8a16": BF16_ORACLE,
    "ct_llama_fp8": FP8_ACTIVATIONS,
    "ct_qwen2_fp8_dynamic": FP8_ACTIVATIONS,
    "modelopt_llama_fp8": FP8_ACTIVATIONS,
    "gptq_mixtral_moe": EXACT,  # experts stacked, the router unquantized
    "ct_qwen2moe_w4a16": EXACT,  # and a shared expert; routers in the ignore list
    "bnb_llama_nf4": (5e-3, 3e-3),  # float16 oracles (bitsandbytes' dequantize_4bit in the weights' dtype)
    "bnb_qwen2_fp4": (5e-3, 3e-3),
}
PRESENT = [name for name in CASES if (DATA / name).is_dir()]


def _texts():
    return ["def parse(text):\n    return json.loads(", "The decoder reads the stream", "class Encoder:"]


def _oracle(name: str):
    """The float32 HF model on the producer's dequantized weights, activations quantized as the checkpoint says."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = json.loads((DATA / name / "config.json").read_text())
    qc = hf.pop("quantization_config")
    config = AutoConfig.for_model(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")},
                                  model_type=hf["model_type"])
    config.architectures = hf["architectures"]
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with safe_open(str(DATA / f"{name}.dequantized.safetensors"), "pt") as f:
        oracle = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(str(DATA / name / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    for key, w in stored.items():  # FP8: fp8 * scale exactly (compressed-tensors' oracle rounds it to
        if w.dtype == FP8:          # bf16, and the activations' 8-bit grid would turn that into flips)
            scale = stored[key + "_scale"].float()
            oracle[key] = w.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
    state = {k: (oracle[k] if k in oracle else stored[k]).float() for k in model.state_dict()
             if k in oracle or k in stored}
    model.load_state_dict(state, strict=False)
    missing = set(model.state_dict()) - set(state)
    assert missing <= {"lm_head.weight"} and (not missing or config.tie_word_embeddings), missing
    if model.config.tie_word_embeddings:
        model.tie_weights()
    _quantize_activations(model, oracle, qc)
    return model


def _quantize_activations(model, oracle, qc):
    dynamic = _fp8_dynamic(qc)
    for name, module in model.named_modules():
        scale = oracle.get(f"{name}.input_scale")
        if scale is None and not (dynamic and f"{name}.weight" in oracle):
            continue

        def hook(mod, args, scale=scale):
            x = args[0]
            s = scale.float() if scale is not None else (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
            return ((x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s,)

        module.register_forward_pre_hook(hook)


def _fp8_dynamic(qc) -> bool:
    groups = qc.get("config_groups") or {}
    return any((g.get("input_activations") or {}).get("dynamic") is True for g in groups.values()
               if (g.get("input_activations") or {}).get("type") == "float")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = {}

    def get(name, tp=1):
        if (name, tp) not in cache:
            root = tmp_path_factory.mktemp(f"prequant_{name}_tp{tp}")
            ckpt = convert_checkpoint(DATA / name, root / "ckpt", dtype="float32", tp_size=tp)
            cache[name, tp] = build_engine(ckpt, root / "engine", BuildConfig(**TEST_BUILD, backend="eager"),
                                           log=lambda *_: None)
        return cache[name, tp]

    return get


def _prompts(name):
    from kiln.runtime.frontend.tokenizer import load_tokenizer

    tok = load_tokenizer(DATA / name)  # the ct_* ones were saved by transformers 5
    return [tok.encode(t) for t in _texts()]


HF_PARTS = {"attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "attention.dense": ("self_attn.o_proj",), "mlp.fc": ("mlp.gate_proj",), "mlp.gate": ("mlp.up_proj",),
            "mlp.proj": ("mlp.down_proj",)}
# A mixture's experts, stacked: Kiln's fc is each expert's up rows then its gate rows
EXPERTS = {"mixtral": ("block_sparse_moe.experts.{e}.", ("w3", "w1"), "w2"),
           "qwen2_moe": ("mlp.experts.{e}.", ("up_proj", "gate_proj"), "down_proj")}
SHARED = {"mlp.shared_expert.fc": ("mlp.shared_expert.gate_proj",), "mlp.shared_expert.gate": (
    "mlp.shared_expert.up_proj",), "mlp.shared_expert.proj": ("mlp.shared_expert.down_proj",)}


def _kiln_linears(hf: dict) -> dict[str, list[tuple[str, ...]]]:
    """Kiln linear -> its HF parts, one tuple per expert for a mixture's stacked experts."""
    if hf["model_type"] not in EXPERTS:
        return {k: [v] for k, v in HF_PARTS.items()}
    prefix, fc, proj = EXPERTS[hf["model_type"]]
    experts = hf.get("num_local_experts") or hf["num_experts"]
    out = {k: [HF_PARTS[k]] for k in ("attention.qkv", "attention.dense")}
    out["mlp.fc"] = [tuple(prefix.format(e=e) + p for p in fc) for e in range(experts)]
    out["mlp.proj"] = [(prefix.format(e=e) + proj,) for e in range(experts)]
    if hf.get("shared_expert_intermediate_size"):
        out.update({k: [v] for k, v in SHARED.items()})
    return out


@pytest.mark.parametrize("name", PRESENT)
def test_converted_weights_are_the_producers_dequantized_weights(name, tmp_path):
    """Every linear of the Kiln checkpoint stands for the weight the producer's own code dequantizes,
    up to the rounding of the oracle's dtype (compressed-tensors and bitsandbytes dequantize in bf16/fp16)."""
    from safetensors.torch import load_file

    from kiln.convert.quantize.rtn import dequantize_linear

    ckpt = convert_checkpoint(DATA / name, tmp_path / "ckpt", dtype="float32")
    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    tensors = load_file(ckpt / "rank0.safetensors")
    oracle = load_file(DATA / f"{name}.dequantized.safetensors")
    linears = _kiln_linears(json.loads((DATA / name / "config.json").read_text()))
    for layer in range(2):
        for kiln, experts in linears.items():
            prefix = f"transformer.layers.{layer}.{kiln}"
            mine = {k[len(prefix) + 1:]: t for k, t in tensors.items() if k.startswith(prefix + ".")}
            want = torch.stack([torch.cat([oracle[f"model.layers.{layer}.{p}.weight"] for p in parts]).float()
                                for parts in experts])
            want = want if len(experts) > 1 else want[0]
            got = dequantize_linear(mine, q["quant_algo"], q["group_size"]) if q["quant_algo"] else mine["weight"]
            assert got.shape == want.shape, prefix
            torch.testing.assert_close(got, want, rtol=2 ** -8, atol=1e-6, msg=prefix)


@pytest.mark.parametrize("name", PRESENT)
def test_logits_and_greedy_tokens_match_the_dequantized_checkpoint(name, converted):
    model, prompts = _oracle(name), _prompts(name)
    engine_dir = converted(name)
    ours = engine_logits(RankEngine(engine_dir, max_tokens_in_paged_kv_cache=1024), prompts)
    with torch.no_grad():
        per_position = torch.cat([(got - model(torch.tensor([seq])).logits[0]).abs().amax(-1)
                                  for seq, got in zip(prompts, ours)])
    worst, median = per_position.max().item(), per_position.median().item()
    print(f"{name}: max |Δlogit| {worst:.2e}, median over positions {median:.2e}")
    assert worst < CASES[name][0] and median < CASES[name][1]
    llm = LLM(engine_dir)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                                       ignore_eos=True))]
    finally:
        llm.llm_engine.shutdown()
    if CASES[name] in (EXACT, FP8_ACTIVATIONS):  # a float32 oracle: the same tokens
        with torch.no_grad():
            want = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   min_new_tokens=NEW_TOKENS)[0, len(p):].tolist() for p in prompts]
        assert got == want
        return
    # An oracle rounded to 16 bits may break a near tie the other way: each of our tokens is the oracle's
    # greedy choice on our sequence up to that rounding.
    for p, g in zip(prompts, got):
        with torch.no_grad():
            logits = model(torch.tensor([p + g])).logits[0, len(p) - 1:-1]
        gap = logits.amax(-1) - logits.gather(-1, torch.tensor(g)[:, None])[:, 0]
        assert gap.max().item() <= CASES[name][0], (g, gap)


# -- bad input: one line naming what is wrong ---------------------------------------------------

def _copy(name: str, dest: Path, config_edit=None, tensor_edit=None) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(DATA / name, dest)
    if config_edit:
        hf = json.loads((dest / "config.json").read_text())
        config_edit(hf["quantization_config"])
        (dest / "config.json").write_text(json.dumps(hf))
    if tensor_edit:
        tensors = load_file(dest / "model.safetensors")
        tensor_edit(tensors)
        save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def _convert_cli(model_dir: Path, out: Path, *extra: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "kiln.convert.cli", "--model_dir", str(model_dir), "--output_dir",
                           str(out), *extra], capture_output=True, text=True, timeout=300)


BAD = {
    "nvfp4": ("modelopt_llama_fp8", lambda qc: qc.update(quant_algo="NVFP4"), None, "quant_algo='NVFP4'"),
    "gptq_3bit": ("gptq_qwen2_g32_asym", lambda qc: qc.update(bits=3), None, "bits=3"),
    "gptq_marlin": ("gptq_qwen2_g32_asym", lambda qc: qc.update(checkpoint_format="marlin"), None,
                    "checkpoint_format='marlin'"),
    "ct_nvfp4": ("ct_llama_w4a16", lambda qc: qc.update(format="nvfp4-pack-quantized") or
                 qc["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"), None, "FP4"),
    "bnb_8bit": ("bnb_llama_nf4", lambda qc: qc.update(load_in_8bit=True, load_in_4bit=False), None, "load_in_8bit"),
    "damaged_qzeros": ("gptq_qwen2_g32_asym", None,
                       lambda t: t.update({"model.layers.1.mlp.up_proj.qzeros":
                                           t["model.layers.1.mlp.up_proj.qzeros"][:, :-1].contiguous()}),
                       "model.layers.1.mlp.up_proj.qzeros"),
    "wrong_shape": ("awq_llama_gemm", None,  # consistent with itself, not with config.json's [256, 128]
                    lambda t: t.update({f"model.layers.0.mlp.up_proj.{k}": t[f"model.layers.0.mlp.up_proj.{k}"][:, :8]
                                        .contiguous() for k in ("qweight", "qzeros", "scales")} |
                                       {"model.layers.0.mlp.up_proj.scales": t["model.layers.0.mlp.up_proj.scales"]
                                        [:, :64].contiguous()}),
                    "model.layers.0.mlp.up_proj: its awq tensors stand for a [64, 128] weight, expected [256, 128]"),
    "damaged_packed": ("ct_qwen2_w4a16_asym", None,
                       lambda t: t.update({"model.layers.0.self_attn.k_proj.weight_packed":
                                           t["model.layers.0.self_attn.k_proj.weight_packed"][:-2].contiguous()}),
                       "model.layers.0.self_attn.k_proj.weight_packed"),
}


@pytest.mark.parametrize("case", BAD)
def test_what_kiln_cannot_run_is_one_line_naming_it(case, tmp_path):
    name, config_edit, tensor_edit, named = BAD[case]
    if not (DATA / name).is_dir():
        pytest.skip(f"fixture {name} missing")
    model = _copy(name, tmp_path / "model", config_edit, tensor_edit)
    run = _convert_cli(model, tmp_path / "out")
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], run.stderr
    assert not (tmp_path / "out").exists()


def test_requantizing_an_exact_checkpoint_or_contradicting_it_is_refused(tmp_path):
    from kiln.config import ConfigError
    from kiln.vllm_args import EngineArgs, resolve

    run = _convert_cli(DATA / "gptq_qwen2_g32_asym", tmp_path / "out", "--qformat", "int4_wo")
    assert run.returncode == 1 and "already quantized" in run.stderr and "drop --qformat" in run.stderr, run.stderr
    run = _convert_cli(DATA / "bnb_llama_nf4", tmp_path / "requantized", "--qformat", "int4_wo")
    assert run.returncode == 0, run.stderr
    assert "dequantized to float16, then quantized int4_wo" in run.stderr + run.stdout
    assert json.loads((tmp_path / "requantized" / "config.json").read_text())["quantization"]["quant_algo"] == "W4A16"
    run = _convert_cli(DATA / "bnb_llama_nf4", tmp_path / "out2", "--qformat", "int4_awq")
    assert run.returncode == 1 and "expected one of int4_wo, int8_wo" in run.stderr, run.stderr
    with pytest.raises(ConfigError, match=r"model config \(gptq\) does not match .* argument \(awq\)"):
        resolve(EngineArgs(model=str(DATA / "gptq_qwen2_g32_asym"), quantization="awq"))
    with pytest.raises(ConfigError, match=r"model config \(bitsandbytes\) does not match .* argument \(fp8\)"):
        resolve(EngineArgs(model=str(DATA / "bnb_llama_nf4"), quantization="fp8"))


# -- tensor parallelism: packed tensors split at group boundaries ---------------------------------

def _greedy(engine_dir, prompts):
    llm = LLM(engine_dir)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                                       ignore_eos=True))]
    finally:
        llm.llm_engine.shutdown()


# act-order's down_proj order moved onto gate/up; zero points, group 32, the qkv bias and the KV heads
# split; FP8 per-tensor scales that differ between q, k and v (per-row ones, split with the rows); int4
# experts split over the ranks (each expert's width, as a dense MLP's). Not
# per-token FP8: a row-parallel linear's ranks each scale their own slice of a token's activations (as
# vLLM's do), which is not the one scale a single rank takes.
@pytest.mark.parametrize("name", ["gptq_llama_g128_desc", "gptq_qwen2_g32_asym", "awq_llama_gemm", "ct_llama_fp8",
                                  "gptq_mixtral_moe"])
def test_tp2_same_tokens_as_tp1(name, converted):
    from kiln.config import ConfigError, EngineConfig
    from kiln.models.lora import check_lora_config

    prompts = _prompts(name)
    engine_dir = converted(name, tp=2)
    assert _greedy(engine_dir, prompts) == _greedy(converted(name), prompts)
    pretrained = EngineConfig.load(engine_dir).pretrained_config
    assert pretrained.quantization.mlp_channels_by_group == name.endswith("desc")  # gate/up rows in group order
    if pretrained.quantization.mlp_channels_by_group:
        with pytest.raises(ConfigError, match="mlp_4h_to_h: this checkpoint's MLP channels are in its act-order"):
            check_lora_config({"max_lora_rank": 4, "lora_target_modules": ["attn_q", "mlp_4h_to_h"]}, pretrained)


# -- the guide's serve lines, verbatim but for the model path -------------------------------------

GUIDE = {"vllm serve {model} --quantization awq": "awq_llama_gemm",
         "vllm serve {model} --quantization fp8": "ct_llama_fp8"}


def test_the_guides_quantized_serve_lines_answer_completions(env, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from test_vllm_commands import Serve

    def one(line):
        model = DATA / GUIDE[line]
        server = Serve(line, env, tmp_path / f"{GUIDE[line]}.log", model=model)
        try:
            reply = server.client.completions.create(model=str(model), prompt="def parse(text):", max_tokens=8,
                                                     temperature=0)
            return reply.usage.completion_tokens, reply.choices[0].finish_reason
        finally:
            log = server.stop()
            assert "without re-quantizing" in log, log[-2000:]

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(one, GUIDE)) == [(8, "length")] * 2


def _finer_act_order(tmp_path: Path) -> Path:
    """gptq_llama_g128_desc re-cut into groups of 64 (the same weights: each group's scale and zero point on
    both its halves), with every linear's halves chosen out of order: act-order q/k/v, o_proj and gate/up
    besides down_proj, each gathered at run time."""
    def edit(t):
        g, halves = torch.Generator().manual_seed(0), {}
        for name in sorted(k[:-len(".g_idx")] for k in t if k.endswith(".g_idx")):
            g_idx = t[f"{name}.g_idx"].long()
            # linears sharing an input share its order, as GPTQ's (one Hessian) do
            shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            if shared not in halves:
                half = torch.zeros_like(g_idx)
                for group in g_idx.unique():
                    members = (g_idx == group).nonzero()[:, 0]
                    half[members[torch.randperm(len(members), generator=g)[:len(members) // 2]]] = 1
                halves[shared] = half
            t[f"{name}.g_idx"] = (2 * g_idx + halves[shared]).to(torch.int32)
            for key in ("scales", "qzeros"):
                t[f"{name}.{key}"] = t[f"{name}.{key}"].repeat_interleave(2, dim=0).contiguous()

    return _copy("gptq_llama_g128_desc", tmp_path / "model", lambda qc: qc.update(group_size=64), edit)


def test_act_order_inputs_are_gathered_and_o_proj_is_not_split(tmp_path):
    from safetensors.torch import load_file

    model = _finer_act_order(tmp_path)
    ckpt = convert_checkpoint(model, tmp_path / "ckpt", dtype="float32")
    tensors = load_file(ckpt / "rank0.safetensors")
    assert {"attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"} == {
        k.split(".", 3)[3].rsplit(".", 1)[0] for k in tensors if k.endswith("input_index")}
    engine_dir = build_engine(ckpt, tmp_path / "engine", BuildConfig(**TEST_BUILD, backend="eager"),
                              log=lambda *_: None)
    oracle, prompts = _oracle("gptq_llama_g128_desc"), _prompts("gptq_llama_g128_desc")
    ours = engine_logits(RankEngine(engine_dir, max_tokens_in_paged_kv_cache=1024), prompts)
    with torch.no_grad():
        worst = max((got - oracle(torch.tensor([seq])).logits[0]).abs().max().item() for seq, got in zip(prompts, ours))
    assert worst < EXACT[0], worst
    run = _convert_cli(model, tmp_path / "tp2", "--tp_size", "2")
    assert run.returncode == 1 and "o_proj weights cannot be split over --tp_size 2" in run.stderr, run.stderr


def test_lora_on_an_act_order_gptq_base_matches_peft(tmp_path):
    """Adapters on every module of an int4 base whose linears all gather their inputs (act-order), as HF's
    PeftModel runs them over the producer's dequantized weights."""
    import peft

    from kiln import LoRARequest

    model = _finer_act_order(tmp_path)
    oracle, prompts = _oracle("gptq_llama_g128_desc"), _prompts("gptq_llama_g128_desc")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = peft.get_peft_model(oracle, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        want = [peft_model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False)[0, len(p):].tolist() for p in prompts]
    ckpt = convert_checkpoint(model, tmp_path / "ckpt", dtype="float32")
    lora = {"max_lora_rank": 4, "lora_target_modules": ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h",
                                                        "mlp_4h_to_h", "mlp_gate"]}
    engine_dir = build_engine(ckpt, tmp_path / "engine", BuildConfig(**TEST_BUILD, backend="eager", lora_config=lora),
                              log=lambda *_: None)
    llm = LLM(engine_dir)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True),
            lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))]
    finally:
        llm.llm_engine.shutdown()
    assert got == want
