"""Make the GPTQ fixtures next to this file with GPTQModel (the real producer), plus a dequantized oracle for each.

Producer: GPTQModel 5.0.0 (CPU quantization, pure-python torch kernels; no CUDA extension built), in a scratch
venv outside the repo, Python 3.11:

    python3.11 -m venv /tmp/venv-q
    /tmp/venv-q/bin/pip install torch==2.13.0 transformers==4.57.6 setuptools wheel     # torch 2.13.0+cpu
    BUILD_CUDA_EXT=0 /tmp/venv-q/bin/pip install --no-deps --no-build-isolation gptqmodel==5.0.0
    /tmp/venv-q/bin/pip install -c <(printf 'torch==2.13.0+cpu\ntransformers==4.57.6\n') \
        accelerate threadpoolctl device-smi protobuf pillow pypcre tokenicer logbar dill random_word hf_transfer \
        'datasets>=3.6.0,<4.5' 'huggingface_hub>=0.34.4,<1.0'
    /tmp/venv-q/bin/python tests/data/prequant/make_gptq.py

(gptqmodel 5.0.0 is the newest release whose requirements accept transformers 4.57.x; newer ones need
transformers 5.x. --no-build-isolation because its setup.py must see the installed torch; --no-deps because it pins
numpy==2.2.6 and wants torchao/maturin, which the CPU quantize/pack/load path used here does not import.)
Versions resolved: torch 2.13.0+cpu, transformers 4.57.6, accelerate 1.x, safetensors 0.8.0, numpy 2.4.6.

Workaround: gptqmodel 5.0.0's import builds a thread pool asking for 2 "model_loader:cpu" workers out of
cpu_count()//2; on a 2-core machine that raises, so os.cpu_count is patched to 4 before the import.

Oracle (<name>.dequantized.safetensors): the checkpoint is loaded back by GPTQModel itself
(GPTQModel.load(..., backend=BACKEND.TORCH), which converts gptq(v1) qzeros to its internal v2 form on load), and
each TorchQuantLinear's own `dequantize_weight()` is called on a load with dtype=float32 (its fp16 scales widened
exactly, so the oracle is scale * (q - zero) in float32, not rounded to fp16); transposed to nn.Linear's [out, in]; float32.
"""
import os
import sys

os.cpu_count = lambda: 4  # see docstring

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file, load_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from base import calibration_texts, make_base  # noqa: E402

FIXTURES = {
    # name: (arch, QuantizeConfig kwargs, load dtype)
    "gptq_llama_g128_desc": ("llama", dict(bits=4, group_size=128, desc_act=True, sym=True), torch.float16),
    "gptq_qwen2_g32_asym": ("qwen2", dict(bits=4, group_size=32, desc_act=False, sym=False), torch.float16),
    "gptq_llama_8bit": ("llama", dict(bits=8, group_size=-1, desc_act=False, sym=True, act_group_aware=False), "auto"),
    # ^ producer default dtype (bf16); act_group_aware=False because gptqmodel 5.0.0's default GAR reordering crashes
    #   on group_size=-1 ("invalid shape dimension -128" in gar.compute_local_perms)
    "gptq_qwen2_g64_v2": ("qwen2", dict(bits=4, group_size=64, desc_act=False, sym=False, format="gptq_v2"),
                          torch.float16),
}


def quantize(name, arch, qkw, dtype, work):
    from gptqmodel import GPTQModel, QuantizeConfig

    base = work / f"base_{arch}"
    if not base.exists():
        make_base(arch, base)
    torch.manual_seed(0)
    qc = QuantizeConfig(offload_to_disk=False, **qkw)
    model = GPTQModel.load(str(base), qc, dtype=dtype)
    model.quantize(calibration_texts(), batch_size=1)
    out = HERE / name
    if out.exists():
        shutil.rmtree(out)
    model.save(str(out))
    return base, out


def oracle_and_check(name, base, out):
    import transformers
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    # dtype=float32: the checkpoint's fp16/bf16 scales are widened exactly (the default would round them to bf16)
    qmodel = GPTQModel.load(str(out), device="cpu", backend=BACKEND.TORCH, dtype=torch.float32)
    oracle = {}
    for mod_name, mod in qmodel.model.named_modules():
        if isinstance(mod, BaseQuantLinear):
            assert mod.scales.dtype == torch.float32
            w = mod.dequantize_weight()  # [in, out]
            oracle[f"{mod_name}.weight"] = w.T.contiguous().float()
    save_file(oracle, str(HERE / f"{name}.dequantized.safetensors"))

    # forward check: float32 base model with oracle weights + every other tensor from the checkpoint, against
    # GPTQModel's own quantized forward (TorchQuantLinear), loaded in float32 and in the checkpoint's dtype
    ids = qmodel.tokenizer(calibration_texts(1, 200)[0], return_tensors="pt").input_ids[:, :48]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    sd = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()
          if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) and "rotary_emb" not in k}
    sd.update(oracle)
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and ref.config.tie_word_embeddings)]
    assert not missing and not unexpected, (missing, unexpected)
    if ref.config.tie_word_embeddings:
        ref.tie_weights()
    with torch.no_grad():
        o_logits = ref(ids).logits
    ckpt_dtype = getattr(torch, json.loads((out / "config.json").read_text())["dtype"])
    d = {}
    for dtype in (torch.float32, ckpt_dtype):
        qm = GPTQModel.load(str(out), device="cpu", backend=BACKEND.TORCH, dtype=dtype)
        with torch.no_grad():
            q_logits = qm.model(ids).logits.float()
        d[str(dtype)] = (o_logits - q_logits).abs().max().item()
    print(f"[{name}] max|dlogit| oracle-fp32 vs GPTQModel TorchQuantLinear forward: {d} "
          f"(max|logit| {o_logits.abs().max().item():.3g}, {ids.shape[1]} tokens)")
    return d


def main():
    names = sys.argv[1:] or list(FIXTURES)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results = {}
        for name in names:
            arch, qkw, dtype = FIXTURES[name]
            base, out = quantize(name, arch, qkw, dtype, work)
            results[name] = oracle_and_check(name, base, out)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
