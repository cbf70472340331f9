"""Makes the bitsandbytes fixtures `bnb_llama_nf4/` and `bnb_qwen2_fp4/` (+ `<name>.dequantized.safetensors`) here.

Producer: bitsandbytes 0.50.2 (its CPU backend) through transformers 4.57.6 and accelerate 1.16.0, on torch 2.13.0+cpu,
in a scratch venv outside the repo:
    python3 -m venv /tmp/venv-bnb
    /tmp/venv-bnb/bin/pip install torch==2.13.0 transformers==4.57.6
    /tmp/venv-bnb/bin/pip install "bitsandbytes==0.50.*" accelerate
    /tmp/venv-bnb/bin/python tests/data/prequant/make_bnb.py

Recipe: `AutoModelForCausalLM.from_pretrained(base, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type=..., bnb_4bit_use_double_quant=..., bnb_4bit_compute_dtype=torch.float32), device_map="cpu")`
then `save_pretrained` — bnb_llama_nf4: NF4 with double quant; bnb_qwen2_fp4: FP4 without double quant
(bnb's default blocksize 64 for both; no calibration in bitsandbytes).

Oracle: for each quantized linear, `bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)`
(bitsandbytes' own dequantization) as float32 [out, in]. It is checked two ways: the same dequantization of the
state rebuilt from the saved checkpoint (`Params4bit.from_prequantized`, bnb's loader path) must be equal, and a forward of
the base model with the oracle weights must match the bnb-quantized model's own forward.
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from base import calibration_texts, make_base  # noqa: E402

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
FIXTURES = {"bnb_llama_nf4": ("llama", "nf4", True), "bnb_qwen2_fp4": ("qwen2", "fp4", False)}


def make(name: str, arch: str, quant_type: str, double_quant: bool, out_root: Path, tmp: Path) -> dict:
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    base = make_base(arch, tmp / f"base_{arch}")
    tok = AutoTokenizer.from_pretrained(base)
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                             bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=cfg, device_map="cpu").eval()
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)

    probe = tok(calibration_texts(1, 200)[0], return_tensors="pt").input_ids[:, :48]
    oracle = {}
    with torch.no_grad():
        ref_logits = model(probe).logits.float()
        for i in range(model.config.num_hidden_layers):
            for lin in LINEARS:
                mod = model.get_submodule(f"model.layers.{i}.{lin}")
                assert isinstance(mod, bnb.nn.Linear4bit), type(mod)
                oracle[f"model.layers.{i}.{lin}.weight"] = bnb.functional.dequantize_4bit(
                    mod.weight.data, mod.weight.quant_state).float().contiguous()
    save_file(oracle, str(out_root / f"{name}.dequantized.safetensors"))

    # Check 1: bnb's own loader path from the saved tensors gives the same dequantized weights.
    ck = {}
    for f in sorted(out.glob("*.safetensors")):
        ck.update(load_file(str(f)))
    max_reload = 0.0
    for key, w in oracle.items():
        qs = {k[len(key) + 1:]: v for k, v in ck.items() if k.startswith(key + ".")}
        p = bnb.nn.Params4bit.from_prequantized(data=ck[key], quantized_stats=qs, requires_grad=False, device="cpu")
        max_reload = max(max_reload, (bnb.functional.dequantize_4bit(p.data, p.quant_state).float() - w).abs().max().item())

    # Check 2: oracle weights into the base model (other tensors from the checkpoint), one forward.
    plain = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    sd = plain.state_dict()
    for k in sd:
        if k in oracle:
            sd[k] = oracle[k]
        elif k in ck:
            sd[k] = ck[k].float()
        elif k == "lm_head.weight":  # tied (qwen2): not in the checkpoint
            sd[k] = ck["model.embed_tokens.weight"].float()
        else:
            raise KeyError(k)
    plain.load_state_dict(sd)
    with torch.no_grad():
        got = plain(probe).logits.float()
        got16 = plain.half()(probe).logits.float()  # the bnb model keeps the rest in float16, as it saved it
    return {"fixture": name, "max_abs_dlogit_fp32_oracle_model_vs_bnb_forward": (got - ref_logits).abs().max().item(),
            "max_abs_dlogit_fp16_oracle_model_vs_bnb_forward": (got16 - ref_logits).abs().max().item(),
            "logit_absmax": ref_logits.abs().max().item(), "max_abs_reload_dequant_vs_oracle": max_reload}


def main(out_root: Path = HERE) -> None:
    tmp = Path(tempfile.mkdtemp())
    for name, (arch, qt, dq) in FIXTURES.items():
        print(json.dumps(make(name, arch, qt, dq, out_root, tmp)))
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
