"""Makes the compressed-tensors fixtures `ct_*/` (+ `<name>.dequantized.safetensors`) next to this file.

Producer: llm-compressor (llmcompressor 0.14.0.1) with compressed-tensors 0.19.0 — the version llmcompressor 0.14
pins (`compressed-tensors==0.19.0`; 0.20 cannot be installed beside it) — and transformers 5.17.0 (llmcompressor
0.14 requires transformers>=5.15,<=5.17, so not the 4.57.6 of the project venv), on torch 2.13.0+cpu, in a scratch
venv outside the repo:
    python3 -m venv /tmp/venv-ct
    /tmp/venv-ct/bin/pip install torch==2.13.0
    /tmp/venv-ct/bin/pip install "llmcompressor==0.14.0.1" torch==2.13.0
    /tmp/venv-ct/bin/python tests/data/prequant/make_compressed_tensors.py

Recipe: `oneshot(model=..., dataset=<calibration_texts() tokenized, a datasets.Dataset>,
recipe=QuantizationModifier(targets="Linear", scheme=<preset>, ignore=["lm_head"]))` then
`model.save_pretrained(dir, save_compressed=True)` (the format is the one llmcompressor infers for the scheme).
The base models of base.py are loaded in bfloat16 (llama) or float16 (qwen2) first, so the scales are
stored in that dtype as they are in real checkpoints.

Oracle: the checkpoint loaded back through compressed-tensors' own decompression
(transformers' `CompressedTensorsConfig(dequantize=True)` → `ModelCompressor.decompress_model` → the format's
compressor `decompress` → `compressed_tensors.quantization.lifecycle.forward.dequantize`); each linear's dense
`weight` as float32 [out, in], plus `<name>.input_scale` where the scheme has a static one. Checked with one forward
of the base model holding the oracle weights against llmcompressor's own quantized (fake-quant) model forward.
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
FIXTURES = {  # name: (arch, preset scheme, dtype the base is loaded in)
    "ct_llama_w4a16": ("llama", "W4A16", torch.bfloat16),
    "ct_qwen2_w4a16_asym": ("qwen2", "W4A16_ASYM", torch.float16),
    "ct_llama_w8a16": ("llama", "W8A16", torch.bfloat16),
    "ct_llama_fp8": ("llama", "FP8", torch.bfloat16),
    "ct_qwen2_fp8_dynamic": ("qwen2", "FP8_DYNAMIC", torch.float16),
}


def make(name: str, arch: str, scheme: str, dtype: torch.dtype, out_root: Path, tmp: Path) -> dict:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    base = tmp / f"base_{arch}"
    if not base.exists():
        make_base(arch, base)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).eval()
    enc = [tok(t, truncation=True, max_length=128) for t in calibration_texts()]
    ds = Dataset.from_dict({"input_ids": [e["input_ids"] for e in enc],
                            "attention_mask": [e["attention_mask"] for e in enc]})
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=128, num_calibration_samples=len(enc))

    probe = tok(calibration_texts(1, 200)[0], return_tensors="pt").input_ids[:, :48]
    with torch.no_grad():
        ref_logits = model(probe).logits.float()  # llmcompressor's quantized model: fake-quant forward

    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)

    deq = AutoModelForCausalLM.from_pretrained(
        out, dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    oracle = {}
    for i in range(deq.config.num_hidden_layers):
        for lin in LINEARS:
            key = f"model.layers.{i}.{lin}"
            mod = deq.get_submodule(key)
            oracle[f"{key}.weight"] = mod.weight.detach().float().contiguous()
    ck = {}
    for f in sorted(out.glob("*.safetensors")):
        ck.update(load_file(str(f)))
    for k, v in ck.items():
        if k.endswith(".input_scale"):
            oracle[k] = v.float().contiguous()
    save_file(oracle, str(out_root / f"{name}.dequantized.safetensors"))

    # Check: oracle weights into the base model (other tensors from the checkpoint), one forward.
    res = {"fixture": name, "logit_absmax": ref_logits.abs().max().item()}
    for cdt in (dtype, torch.float32):
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=cdt).eval()
        sd = plain.state_dict()
        for k in sd:
            src = oracle.get(k, ck.get(k))
            if src is None and k == "lm_head.weight":  # tied (qwen2)
                src = ck["model.embed_tokens.weight"]
            sd[k] = src.to(cdt)
        plain.load_state_dict(sd)
        with torch.no_grad():
            got = plain(probe).logits.float()
        res[f"max_abs_dlogit_{str(cdt)[6:]}_oracle_model_vs_llmcompressor_forward"] = (got - ref_logits).abs().max().item()
    with torch.no_grad():
        res["max_abs_dlogit_ct_dequantized_load_vs_llmcompressor_forward"] = (
            deq(probe).logits.float() - ref_logits).abs().max().item()
    return res


def main(out_root: Path = HERE, only: list[str] | None = None) -> None:
    tmp = Path(tempfile.mkdtemp())
    for name, (arch, scheme, dtype) in FIXTURES.items():
        if not only or name in only:
            print(json.dumps(make(name, arch, scheme, dtype, out_root, tmp)), flush=True)
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main(only=sys.argv[1:])
