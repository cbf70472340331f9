"""Make the AWQ fixtures next to this file with AutoAWQ (the real producer), plus a dequantized oracle for each.

Producer: AutoAWQ 0.2.9, its own quantizer run on CPU (no GPU, no awq_ext kernels, no triton), in a scratch venv
outside the repo, Python 3.11:

    python3.11 -m venv /tmp/venv-awq
    /tmp/venv-awq/bin/pip install torch==2.13.0 transformers==4.51.3                    # torch 2.13.0+cpu
    /tmp/venv-awq/bin/pip install --no-deps autoawq==0.2.9
    /tmp/venv-awq/bin/pip install -c <(printf 'torch==2.13.0+cpu\n') accelerate 'datasets>=2.20,<4.5' zstandard \
        'huggingface_hub>=0.26.5,<1.0' typing_extensions
    /tmp/venv-awq/bin/python tests/data/prequant/make_awq.py

transformers 4.51.3, not the repo's 4.57.6: AutoAWQ 0.2.9 (its last release, deprecated upstream) imports
transformers.activations.PytorchGELUTanh, which 4.57 no longer has; 4.51.3 is the release it was made against.
--no-deps: it requires triton (GPU only), which the CPU path does not need.

Flow = AutoAWQ's README: AutoAWQForCausalLM.from_pretrained(base) -> quantize(tokenizer, quant_config, calib_data=
list of strings, calibration_texts(32, 256): AutoAWQ drops samples longer than max_calib_seq_len=256 tokens) -> save_quantized(dir) + tokenizer.save_pretrained(dir). Its quantizer computes in float16 on CPU.

Oracle (<name>.dequantized.safetensors), float32, [out, in]:
- GEMM: AutoAWQ's own unpacker awq.utils.packing_utils.dequantize_gemm(qweight, qzeros, scales, 4, group_size) on
  the saved tensors, with the fp16 scales widened to float32 first (so (q - z) * s is exact in float32).
- GEMV: AutoAWQ has no GEMV unpacker (GEMV runs only through CUDA awq_ext kernels), so the oracle is the quantizer's
  own fake-quantized weight: the float16 `linear.weight` that pseudo_quantize_tensor returned and that
  WQLinear_GEMV.from_linear packed (captured by wrapping from_linear); it is (q - z) * s evaluated in float16, i.e.
  within half an fp16 ulp of the exact float32 value. The same capture is made for GEMM and compared with the
  unpacker's result, to show that gap.
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

FIXTURES = {
    "awq_llama_gemm": ("llama", {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}),
    "awq_qwen2_gemv": ("qwen2", {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMV"}),
}


def main():
    import transformers
    from awq import AutoAWQForCausalLM
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.modules.linear.gemv import WQLinear_GEMV
    from awq.utils.packing_utils import dequantize_gemm

    names = sys.argv[1:] or list(FIXTURES)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            arch, quant_config = FIXTURES[name]
            base = make_base(arch, Path(tmp) / f"base_{arch}")
            out = HERE / name
            if out.exists():
                shutil.rmtree(out)

            # capture the fake-quantized weight each linear is packed from
            fake = {}
            cls = WQLinear_GEMM if quant_config["version"] == "GEMM" else WQLinear_GEMV
            orig = cls.from_linear.__func__

            def from_linear(klass, linear, *a, **kw):
                fake[id(linear)] = linear.weight.data.detach().float().cpu().clone()
                q = orig(klass, linear, *a, **kw)
                q._fake_id = id(linear)
                return q

            cls.from_linear = classmethod(from_linear)
            torch.manual_seed(0)
            model = AutoAWQForCausalLM.from_pretrained(str(base), torch_dtype=torch.float16, device_map="cpu")
            tok = transformers.AutoTokenizer.from_pretrained(str(base))
            model.quantize(tok, quant_config=quant_config, calib_data=calibration_texts(32, 256),
                           n_parallel_calib_samples=4, max_calib_samples=32, max_calib_seq_len=256)
            cls.from_linear = classmethod(orig)
            ids = tok(calibration_texts(1, 200)[0], return_tensors="pt").input_ids[:, :48]
            q_logits = None
            if quant_config["version"] == "GEMM":
                # AutoAWQ's own quantized model, in memory right after quantize() (its from_quantized() insists on
                # intel_extension_for_pytorch on CPU): WQLinear_GEMM's naive CPU path = dequantize_gemm + fp16 matmul
                with torch.no_grad():
                    q_logits = model.model(ids).logits.float()
            fake_by_name = {f"{n}.weight": fake[m._fake_id] for n, m in model.model.named_modules()
                            if isinstance(m, cls)}
            model.save_quantized(str(out))
            tok.save_pretrained(str(out))

            sd = load_file(str(out / "model.safetensors"))
            if quant_config["version"] == "GEMM":
                g = quant_config["q_group_size"]
                oracle = {}
                for k in fake_by_name:
                    p = k[:-len(".weight")]
                    w = dequantize_gemm(sd[p + ".qweight"], sd[p + ".qzeros"], sd[p + ".scales"].float(), 4, g)
                    oracle[k] = w.T.contiguous().float()  # [in, out] -> [out, in]
                gap = max((oracle[k] - fake_by_name[k]).abs().max().item() for k in oracle)
                print(f"[{name}] max|dequantize_gemm(fp32) - quantizer fake-quant(fp16)| = {gap:.3g}")
                results[name + ":unpack_vs_fakequant"] = gap
            else:
                oracle = {k: v.contiguous() for k, v in fake_by_name.items()}
            save_file(oracle, str(HERE / f"{name}.dequantized.safetensors"))

            # forward check: float32 base model with oracle weights + every other tensor from the checkpoint
            ref = transformers.AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32).eval()
            other = {k: v.float() for k, v in sd.items() if not k.endswith((".qweight", ".qzeros", ".scales"))}
            other.update(oracle)
            missing, unexpected = ref.load_state_dict(other, strict=False)
            missing = [k for k in missing if not (k == "lm_head.weight" and ref.config.tie_word_embeddings)]
            assert not missing and not unexpected, (missing, unexpected)
            if ref.config.tie_word_embeddings:
                ref.tie_weights()
            with torch.no_grad():
                o_logits = ref(ids).logits
            if q_logits is not None:
                d = (o_logits - q_logits).abs().max().item()
                print(f"[{name}] max|dlogit| oracle-fp32 vs AutoAWQ WQLinear_GEMM forward (fp16): {d:.4g} "
                      f"(max|logit| {o_logits.abs().max().item():.3g})")
                results[name] = d
            else:
                # WQLinear_GEMV.forward needs the CUDA awq_ext kernels: AutoAWQ has no CPU forward for GEMV.
                results[name] = "no CPU forward for GEMV"
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
