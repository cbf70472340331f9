"""Quantize a tiny HF model with NVIDIA ModelOpt and export its TensorRT-LLM checkpoint.

The fake-quantized model ModelOpt leaves behind is the oracle for quantized engines: its forward
simulates every quantizer. Export changes the model in place where TensorRT-LLM fuses layers (one
pre-quant scale and input scale for q/k/v), so the oracle is read after export; two things the
checkpoint states differently from the quantizers are copied back into them so that both describe
one model: pre-quant scales (stored rounded to 16 bits) and KV-cache scales (exported as one scale
for K and V, FP8 ones clamped to >= 1). The exported weights themselves differ from the quantizers'
by one step in a few elements (export divides by the scale in 16-bit arithmetic), so the oracle's
weights become the exported ones, dequantized: its weight quantizers map them onto themselves.
The int4 unpacking this uses is held to ModelOpt's packing in test_quant_engine.
"""
import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

ALGOS = {  # quant_algo -> ModelOpt config
    "W8A16": "INT8_WEIGHT_ONLY_CFG",
    "W4A16_AWQ": "INT4_AWQ_CFG",
    "FP8": "FP8_DEFAULT_CFG",
    "W8A8_SQ_PER_CHANNEL": "INT8_SMOOTHQUANT_CFG",
    "W4A8_AWQ": "W4A8_AWQ_BETA_CFG",
}
LINEARS = {"attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "attention.dense": ("self_attn.o_proj",), "mlp.fc": ("mlp.gate_proj",),
           "mlp.gate": ("mlp.up_proj",), "mlp.proj": ("mlp.down_proj",)}
KV_BITS = {"FP8": (4, 3), "INT8": 8}
KV_MAX = {"FP8": 448.0, "INT8": 127.0}


def modelopt_config(algo: str, group_size: int, kv: str | None):
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, ALGOS[algo]))
    for entry in cfg["quant_cfg"]:
        for c in entry.get("cfg") if isinstance(entry.get("cfg"), list) else [entry.get("cfg") or {}]:
            if "block_sizes" in c:
                c["block_sizes"][-1] = group_size
    if kv:
        cfg["quant_cfg"].append({"quantizer_name": "*[kv]_bmm_quantizer",
                                 "cfg": {"num_bits": KV_BITS[kv], "axis": None}})
    return cfg


def export(hf_dir: Path, out: Path, algo: str, kv: str | None = None, group_size: int = 32,
           dtype=torch.bfloat16, decoder_type: str = "llama"):
    """-> (checkpoint dir, fake-quantized float32 HF model).

    ModelOpt exports fp16/bf16 only. The model's weights are rounded to `dtype` first, so the
    checkpoint's unquantized tensors hold exactly the oracle's weights, and a float32 engine built
    from it (see as_float32) can be compared with the oracle without 16-bit rounding in the way."""
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype))
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, vocab, (2, 48), generator=generator) for _ in range(4)]

    def calibrate(m):
        for ids in batches:
            m(ids)

    mtq.quantize(model, modelopt_config(algo, group_size, kv), calibrate)
    with torch.inference_mode():
        export_tensorrt_llm_checkpoint(model, decoder_type, dtype, export_dir=out, inference_tensor_parallel=1)
    weights = load_file(out / "rank0.safetensors")
    group = json.loads((out / "config.json").read_text())["quantization"].get("group_size")
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            p = f"transformer.layers.{i}."
            for ours, theirs in LINEARS.items():
                pqs = weights.get(f"{p}{ours}.prequant_scaling_factor")
                modules = [layer.get_submodule(name) for name in theirs]
                deq = _dequantize(weights, p + ours, group).split([m.weight.shape[0] for m in modules])
                for module, w in zip(modules, deq):
                    module.weight = torch.nn.Parameter(w, requires_grad=False)  # an inference tensor after export
                    if pqs is not None:
                        module.input_quantizer.pre_quant_scale = pqs.float()
            if kv:
                amax = weights[p + "attention.kv_cache_scaling_factor"].float() * KV_MAX[kv]
                for q in (layer.self_attn.k_bmm_quantizer, layer.self_attn.v_bmm_quantizer):
                    q.amax = amax.reshape(q.amax.shape)
    return out, model


def _dequantize(weights, name, group):
    from kiln.plugins import quant

    q, s = weights[name + ".weight"], weights[name + ".weights_scaling_factor"]
    if q.shape[0] * 2 == s.shape[0]:  # int4 (for W4A8, the int4 quantizer's output)
        return quant.dequantize_int4(q, s, group)
    return q.float() * (s if s.numel() == 1 else s[:, None])


def as_float32(checkpoint: Path, out: Path) -> Path:
    """The same checkpoint declared float32: its 16-bit tensors widen exactly when the engine loads them."""
    out.mkdir(parents=True)
    config = json.loads((checkpoint / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    (out / "rank0.safetensors").symlink_to(checkpoint / "rank0.safetensors")
    return out
