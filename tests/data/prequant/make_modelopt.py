"""Makes the ModelOpt fixture `modelopt_llama_fp8/` (+ `modelopt_llama_fp8.dequantized.safetensors`) next to this file.

Producer: NVIDIA ModelOpt (nvidia-modelopt 0.47.0) on torch 2.13.0+cpu, transformers 4.57.6, run on CPU with the
project's own venv, which has those three (`.venv/bin/python tests/data/prequant/make_modelopt.py`); elsewhere:
`pip install torch==2.13.0 transformers==4.57.6 nvidia-modelopt==0.47.0`.

Recipe: the llama base of base.py loaded in bfloat16 (as ModelOpt checkpoints usually come), then
`mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)` (per-tensor FP8 E4M3 weights, static per-tensor
FP8 input scales from max calibration over calibration_texts()), then
`modelopt.torch.export.export_hf_checkpoint(model, export_dir=...)` (the unified HF checkpoint).

Oracle: for each quantized linear, ModelOpt's own dequantization of the exported weight,
`FP8QTensor(shape, dtype, fp8_weight).dequantize(dtype=torch.float32, scale=weight_scale)`, as float32
[out, in]; plus `<name>.input_scale` (the exported one). ModelOpt's fake-quant forward rounds float32(w) * 448/amax
to FP8, while its export writes `(w / weight_scale).to(torch.float8_e4m3fn)` with the division done in bfloat16
(a 0-dim float32 scale does not promote): that double rounding puts about 3% of the elements one FP8 step away
from the fake-quant weight, so the oracle is what the checkpoint holds, dequantized by ModelOpt. The forward
check runs ModelOpt's fake-quant model with its amaxes set from the exported scales (weight amax =
weight_scale*448, input amax = input_scale*448; the export would unify the input amax of q/k/v and of gate/up,
which share their input anyway) and reports that gap, with and without the input (activation) quantizers.
"""
import copy
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


def main(out_root: Path = HERE) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = "modelopt_llama_fp8"
    tmp = Path(tempfile.mkdtemp())
    base = make_base("llama", tmp / "base")
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.bfloat16).eval()
    batches = [tok(t, return_tensors="pt", truncation=True, max_length=128) for t in calibration_texts()]

    def forward_loop(m):
        with torch.no_grad():
            for b in batches:
                m(**b)

    model = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)
    mtq.print_quant_summary(model)
    probe = tok(calibration_texts(1, 200)[0], return_tensors="pt").input_ids[:, :48]

    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    export_hf_checkpoint(copy.deepcopy(model), export_dir=out)  # the export rewrites the modules in place
    tok.save_pretrained(out)

    from modelopt.torch.quantization.qtensor import FP8QTensor
    ck = {}
    for f in sorted(out.glob("*.safetensors")):
        ck.update(load_file(str(f)))
    oracle, fq_weight = {}, {}
    with torch.no_grad():
        for i in range(model.config.num_hidden_layers):
            for lin in LINEARS:
                key = f"model.layers.{i}.{lin}"
                w8, ws = ck[f"{key}.weight"], ck[f"{key}.weight_scale"]
                oracle[f"{key}.weight"] = FP8QTensor(w8.shape, torch.bfloat16, w8).dequantize(
                    dtype=torch.float32, scale=ws).contiguous()
                oracle[f"{key}.input_scale"] = ck[f"{key}.input_scale"].float().contiguous()
                mod = model.get_submodule(key)  # the quantized (fake-quant) model, with the export's amaxes
                mod.weight_quantizer.amax = (ws.float() * 448.0).reshape(mod.weight_quantizer.amax.shape)
                mod.input_quantizer.amax = (ck[f"{key}.input_scale"].float() * 448.0).reshape(
                    mod.input_quantizer.amax.shape)
                fq_weight[key] = mod.weight_quantizer(mod.weight).float()
        ref_logits = model(probe).logits.float()
        mtq.disable_quantizer(model, "*input_quantizer")
        ref_wonly = model(probe).logits.float()  # weight fake-quant only, activations unquantized
    save_file(oracle, str(out_root / f"{name}.dequantized.safetensors"))

    # Check: oracle weights into the unquantized model (other tensors from the checkpoint), one forward,
    # against ModelOpt's own fake-quant forward (which also quantizes the activations).
    plain = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.bfloat16).eval()
    sd = plain.state_dict()
    for k in sd:
        if k in oracle:
            sd[k] = oracle[k].to(sd[k].dtype)
        elif k in ck:
            sd[k] = ck[k].to(sd[k].dtype)
    plain.load_state_dict(sd)
    with torch.no_grad():
        got = plain(probe).logits.float()
    plain32 = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    sd = {k: (oracle[k] if k in oracle else ck[k].float()) for k in plain32.state_dict()}
    plain32.load_state_dict(sd)
    with torch.no_grad():
        got32 = plain32(probe).logits.float()
    sd.update({f"{k}.weight": v for k, v in fq_weight.items()})
    plain32.load_state_dict(sd)
    with torch.no_grad():
        fq32 = plain32(probe).logits.float()  # fp32 model with ModelOpt's fake-quant weights
    dw = max((fq_weight[k] - oracle[f"{k}.weight"]).abs().max().item() for k in fq_weight)
    # fake-quant rounds x*448/amax in float32; the export rounds bf16(w / scale): a double rounding that moves
    # the odd element one FP8 step (count those beyond bf16 rounding of the fake-quant output)
    nw = sum(((fq_weight[k] - oracle[f"{k}.weight"]).abs() > 2 ** -7 * oracle[f"{k}.weight"].abs() + 1e-6
              ).sum().item() for k in fq_weight)
    print(json.dumps({"max_abs_dlogit_bf16_oracle_model_vs_modelopt_fakequant_forward": (got - ref_logits).abs().max().item(),
                      "max_abs_dlogit_fp32_oracle_model_vs_modelopt_fakequant_forward": (got32 - ref_logits).abs().max().item(),
                      "max_abs_dlogit_bf16_oracle_model_vs_modelopt_weight_only_fakequant_forward": (got - ref_wonly).abs().max().item(),
                      "max_abs_dlogit_fp32_oracle_model_vs_fp32_model_with_modelopt_fakequant_weights": (got32 - fq32).abs().max().item(),
                      "logit_absmax": ref_logits.abs().max().item(),
                      "max_abs(fakequant weight - oracle)": dw, "n_weight_elems_one_fp8_step_apart": nw, "n_weight_elems": sum(v.numel() for v in fq_weight.values())}))
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
