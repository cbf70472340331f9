"""Makes the mixture-of-experts fixtures next to this file, each by its format's real producer, plus a float32
dequantized oracle for each (`<name>.dequantized.safetensors`: every quantized linear's `<module>.weight`, [out, in],
under the checkpoint's HF module names, as the producer's own code dequantizes it).

Bases: base.make_moe_base (hidden 128, 2 layers, 4 heads / 2 KV heads, vocab 384, 4 experts, top-2, seeded float32
weights, initializer_range 0.08), built in the producer's own venv.

gptq_mixtral_moe -- MixtralForCausalLM (expert intermediate 128), GPTQModel 5.0.0, bits=4, group_size=64, sym=True,
desc_act=False, checkpoint_format gptq; base loaded in float16. Producer venv and its os.cpu_count workaround exactly
as in make_gptq.py's docstring (torch 2.13.0+cpu, transformers 4.57.6, gptqmodel 5.0.0 installed --no-deps). GPTQModel's
Mixtral definition lists q/k/v/o_proj and block_sparse_moe.experts.#.w1/w3/w2 only, so the router
(block_sparse_moe.gate), the norms, embed_tokens and lm_head stay unquantized (the script asserts it). Run from /tmp
(GPTQModel writes gptq_log_*.log into the CWD). Workaround: gptqmodel 5.0.0's MixtralQModel lacks the
dynamic_expert_index its "experts.#" tree needs (quantize raises "layer module item
`block_sparse_moe.experts.{expert_index}.w1` not found"); it is set to "num_local_experts", as its GrinMoeQModel (the
same tree) has it.
    cd /tmp && /tmp/venv-q/bin/python /work/main/tests/data/prequant/make_moe.py gptq_mixtral_moe
Oracle: GPTQModel.load(..., backend=BACKEND.TORCH, dtype=float32), each TorchQuantLinear's dequantize_weight()
(the checkpoint's fp16 scales widened exactly), transposed. Check: the float32 base model holding the oracle weights
(every other tensor from the checkpoint) against GPTQModel's own TorchQuantLinear forward, loaded in float32 and fp16.

ct_qwen2moe_w4a16 -- Qwen2MoeForCausalLM (4 experts of 128, a shared expert of 256 with its sigmoid
shared_expert_gate, norm_topk_prob False), llm-compressor scheme "W4A16" (4-bit symmetric, group 128, pack-quantized)
with ignore=["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]; base loaded in bfloat16. Producer venv exactly
as in make_compressed_tensors.py's docstring (llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0,
torch 2.13.0+cpu):
    /tmp/venv-ct/bin/python /work/main/tests/data/prequant/make_moe.py ct_qwen2moe_w4a16
transformers 5 holds a Qwen2-MoE's experts fused (3D gate_up_proj / down_proj parameters, not nn.Linear), so the
experts are first linearized by llm-compressor's own `llmcompressor.modeling.moe.linearize.linearize_moe` (the
post-load path oneshot itself falls back to: one gate/up/down nn.Linear per expert under the checkpoint's names,
mlp.experts.<e>.{gate,up,down}_proj), so "Linear" targets the experts, and saving writes them per expert.
(Not its `load_quantizable_moe()` load: in transformers 5.17 that context's class patching runs dir() over every
imported transformers module, and the `*_fast` image-processor aliases raise without torchvision, not installed here.
In transformers 5.17 the router mlp.gate is a Qwen2MoeTopKRouter holding a bare `weight`, not an nn.Linear, so only
the shared_expert_gate pattern of the ignore list actually matches a Linear; both are kept, as llm-compressor's MoE
examples have them.) Oracle: compressed-tensors' own decompress (the format's compressor `decompress_module`, as
transformers' DecompressExperts calls it) of each quantized linear straight from the checkpoint's tensors, its bf16
weight_scale widened to float32 first, so the oracle is scale * q exactly in float32 (unlike ct_llama_w4a16's
bf16-rounded oracle; a transformers dequantize=True load in float32 still gave the experts in the scales' bf16).
Checked against that transformers bf16 dequantize=True load (= the oracle rounded once to bf16; the experts come out
fused there and are sliced back per expert) and against an unpacking by hand. Check: the float32 HF model (experts
fused as transformers loads them) holding the oracle weights, against llm-compressor's own fake-quant forward of the
calibrated model (in bf16, and cast to float32), and transformers' bf16 dequantized load against the latter.

Results (this machine, 48 probe tokens, max |logit| ~3.7):
  gptq_mixtral_moe: oracle-fp32 vs GPTQModel TorchQuantLinear forward 1.4e-6 (float32 load), 4.4e-3 (fp16 load).
  ct_qwen2moe_w4a16: oracle = hand unpacking exactly; bf16 dequantize=True load = oracle rounded to bf16 exactly;
  transformers' bf16 dequantized load = llm-compressor's bf16 forward exactly (0.0); oracle-fp32 vs llm-compressor's
  bf16 forward 5.2e-2; vs that model cast to float32 0.72 -- one token (12) whose layer-1 router logits have their 2nd
  and 3rd expert 2.4e-4 apart: the bf16 rounding of the weights swaps its top-2 choice (the same 0.69 appears between
  the float32 model on the oracle and on the oracle rounded to bf16; there every other token is under 2e-2).
"""
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from base import calibration_texts, make_moe_base  # noqa: E402

PROBE_TOKENS = 48


def _probe(tok):
    return tok(calibration_texts(1, 200)[0], return_tensors="pt").input_ids[:, :PROBE_TOKENS]


def _tensors(d: Path) -> dict:
    ck = {}
    for f in sorted(d.glob("*.safetensors")):
        ck.update(load_file(str(f)))
    return ck


def _fp32_model_with(base: Path, tensors: dict, tmp: Path):
    """The float32 HF model of `base`'s config, loaded by from_pretrained from exactly `tensors` (checkpoint names)."""
    import transformers

    d = tmp / "oracle_model"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    shutil.copy(base / "config.json", d / "config.json")
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    m, info = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return m.eval()


# ---------------------------------------------------------------------------------------------------- GPTQModel
def gptq_mixtral_moe(tmp: Path) -> dict:
    name = "gptq_mixtral_moe"
    os.cpu_count = lambda: 4  # gptqmodel 5.0.0's import-time thread pool on a 2-core machine (see make_gptq.py)
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from gptqmodel.models.definitions.mixtral import MixtralQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    # gptqmodel 5.0.0's Mixtral definition lacks the expert count its "experts.#" tree needs (every other MoE
    # definition has one; GrinMoeQModel, the same tree, says "num_local_experts"): without it, quantize raises
    # "layer module item `block_sparse_moe.experts.{expert_index}.w1` not found in model"
    if MixtralQModel.dynamic_expert_index is None:
        MixtralQModel.dynamic_expert_index = "num_local_experts"

    base = make_moe_base("mixtral", tmp / "base_mixtral")
    torch.manual_seed(0)
    qc = QuantizeConfig(bits=4, group_size=64, sym=True, desc_act=False, offload_to_disk=False)
    model = GPTQModel.load(str(base), qc, dtype=torch.float16)
    model.quantize(calibration_texts(), batch_size=1)
    out = HERE / name
    if out.exists():
        shutil.rmtree(out)
    model.save(str(out))
    del model

    ck = _tensors(out)
    qmods = sorted(k[:-len(".qweight")] for k in ck if k.endswith(".qweight"))
    for i in range(2):
        assert f"model.layers.{i}.block_sparse_moe.gate.weight" in ck  # router: unquantized
        for lin in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"] + [
                f"block_sparse_moe.experts.{e}.{w}" for e in range(4) for w in ("w1", "w2", "w3")]:
            assert f"model.layers.{i}.{lin}" in qmods, lin
    assert len(qmods) == 2 * (4 + 12), qmods
    for m in qmods:  # desc_act=False: trivial g_idx
        g = ck[f"{m}.g_idx"]
        assert torch.equal(g, torch.arange(g.numel(), dtype=g.dtype) // 64), m

    qmodel = GPTQModel.load(str(out), device="cpu", backend=BACKEND.TORCH, dtype=torch.float32)
    oracle = {}
    for mod_name, mod in qmodel.model.named_modules():
        if isinstance(mod, BaseQuantLinear):
            assert mod.scales.dtype == torch.float32
            oracle[f"{mod_name}.weight"] = mod.dequantize_weight().T.contiguous().float()  # [in, out] -> [out, in]
    assert sorted(oracle) == sorted(f"{m}.weight" for m in qmods)
    save_file(oracle, str(HERE / f"{name}.dequantized.safetensors"))

    ids = _probe(qmodel.tokenizer)
    rest = {k: v for k, v in ck.items() if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    ref = _fp32_model_with(base, {**rest, **oracle}, tmp)
    with torch.no_grad():
        o_logits = ref(ids).logits
    res = {"fixture": name, "logit_absmax": o_logits.abs().max().item(), "tokens": ids.shape[1]}
    for dtype in (torch.float32, torch.float16):
        qm = GPTQModel.load(str(out), device="cpu", backend=BACKEND.TORCH, dtype=dtype)
        with torch.no_grad():
            q_logits = qm.model(ids).logits.float()
        res[f"max_abs_dlogit_oracle_fp32_vs_gptqmodel_torch_forward_{str(dtype)[6:]}"] = (
            (o_logits - q_logits).abs().max().item())
    return res


# ------------------------------------------------------------------------------------------------- llm-compressor
def ct_qwen2moe_w4a16(tmp: Path) -> dict:
    import copy

    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    name, dtype = "ct_qwen2moe_w4a16", torch.bfloat16
    base = make_moe_base("qwen2_moe", tmp / "base_qwen2_moe")
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).eval()
    linearize_moe(model)  # see docstring: what oneshot itself falls back to
    assert isinstance(model.get_submodule("model.layers.0.mlp.experts.0.gate_proj"), torch.nn.Linear)
    enc = [tok(t, truncation=True, max_length=128) for t in calibration_texts()]
    ds = Dataset.from_dict({"input_ids": [e["input_ids"] for e in enc],
                            "attention_mask": [e["attention_mask"] for e in enc]})
    recipe = QuantizationModifier(targets="Linear", scheme="W4A16",
                                  ignore=["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"])
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=128, num_calibration_samples=len(enc))

    probe = _probe(tok)
    with torch.no_grad():
        ref_logits = model(probe).logits.float()  # llm-compressor's quantized model: fake-quant forward
        ref32_logits = copy.deepcopy(model).float()(probe).logits.float()

    out = HERE / name
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    del model

    ck = _tensors(out)
    qmods = sorted(k[:-len(".weight_packed")] for k in ck if k.endswith(".weight_packed"))
    for i in range(2):
        for k in ("mlp.gate.weight", "mlp.shared_expert_gate.weight"):
            assert f"model.layers.{i}.{k}" in ck, k  # routers: unquantized
        for lin in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"] + [
                f"mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")] + [
                f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")]:
            assert f"model.layers.{i}.{lin}" in qmods, lin
    assert len(qmods) == 2 * (4 + 12 + 3), qmods

    oracle = _ct_decompress_fp32(out, ck, qmods)
    save_file(oracle, str(HERE / f"{name}.dequantized.safetensors"))
    res = {"fixture": name, "logit_absmax": ref_logits.abs().max().item(), "tokens": probe.shape[1]}
    # transformers' dequantize=True load in the checkpoint's dtype (compressed-tensors' decompress again, the experts
    # through DecompressExperts, fused): the float32 oracle rounded once to bf16
    in_bf16 = _ct_dequantized(out, qmods, dtype)
    res["max_abs_bf16_load_vs_oracle_rounded_to_bf16"] = max(
        (in_bf16[k] - oracle[k].to(dtype).float()).abs().max().item() for k in oracle)
    # and by hand from the packed int32 words (8 nibbles a word, low first, stored q + 8) x the group's scale
    hand = 0.0
    for m in qmods:
        packed, scale = ck[f"{m}.weight_packed"], ck[f"{m}.weight_scale"].float()
        nib = torch.stack([(packed >> (4 * j)) & 0xF for j in range(8)], dim=-1).reshape(packed.shape[0], -1)
        w = (nib - 8).float() * scale.repeat_interleave(nib.shape[1] // scale.shape[1], dim=1)
        hand = max(hand, (w - oracle[f"{m}.weight"]).abs().max().item())
    res["max_abs_oracle_vs_hand_unpacked"] = hand

    qsuffix = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")
    rest = {k: v for k, v in ck.items() if not k.endswith(qsuffix)}
    plain = _fp32_model_with(base, {**rest, **oracle}, tmp)
    deq = AutoModelForCausalLM.from_pretrained(
        out, dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    with torch.no_grad():
        got = plain(probe).logits.float()
        deq_logits = deq(probe).logits.float()
    res["max_abs_dlogit_oracle_fp32_vs_llmcompressor_forward_bf16"] = (got - ref_logits).abs().max().item()
    res["max_abs_dlogit_oracle_fp32_vs_llmcompressor_forward_cast_fp32"] = (got - ref32_logits).abs().max().item()
    res["max_abs_dlogit_ct_dequantized_load_bf16_vs_llmcompressor_forward_bf16"] = (
        (deq_logits - ref_logits).abs().max().item())
    return res


def _ct_decompress_fp32(out: Path, ck: dict, qmods: list[str]) -> dict:
    """compressed-tensors' own decompress of each quantized linear, its scale widened to float32 first (exact)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qcfg["config_groups"].values()
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"], format=group["format"])
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    res = {}
    for q in qmods:
        mod = torch.nn.Module()
        for part, t in (("weight_packed", ck[f"{q}.weight_packed"]),
                        ("weight_scale", ck[f"{q}.weight_scale"].float()), ("weight_shape", ck[f"{q}.weight_shape"])):
            mod.register_parameter(part, torch.nn.Parameter(t.clone(), requires_grad=False))
        mod.quantization_scheme = scheme
        compressor.decompress_module(mod)
        assert mod.weight.dtype == torch.float32, (q, mod.weight.dtype)
        res[f"{q}.weight"] = mod.weight.detach().contiguous()
    return res


def _ct_dequantized(out: Path, qmods: list[str], dtype: torch.dtype) -> dict:
    """`<module>.weight` (float32, [out, in]) of every quantized linear, from transformers' dequantize=True load."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    m = AutoModelForCausalLM.from_pretrained(
        out, dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    inter = m.config.moe_intermediate_size
    res = {}
    for q in qmods:
        head, _, proj = q.rpartition(".")
        if ".mlp.experts." in q:  # fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
            experts, _, e = head.rpartition(".")
            ex = m.get_submodule(experts)
            w = {"gate_proj": ex.gate_up_proj[int(e), :inter], "up_proj": ex.gate_up_proj[int(e), inter:],
                 "down_proj": ex.down_proj[int(e)]}[proj]
        else:
            w = m.get_submodule(q).weight
        assert w.dtype == dtype, (q, w.dtype)
        res[f"{q}.weight"] = w.detach().float().contiguous()
    return res


FIXTURES = {"gptq_mixtral_moe": gptq_mixtral_moe, "ct_qwen2moe_w4a16": ct_qwen2moe_w4a16}


def main(names: list[str]) -> None:
    for name in names or list(FIXTURES):
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(FIXTURES[name](Path(tmp))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
