"""The accuracy report: the quantized model against the unquantized one on held-out text.

Perplexity of both, the mean KL divergence KL(p_ref || p_quant) of their next-token distributions
and how often their top-1 tokens agree, over the same evaluation windows. The quantized model is
ModelOpt's fake-quant model for the calibrated formats (it also simulates activation and KV cache
quantization), or the HF model carrying the checkpoint's dequantized weights for round-to-nearest.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kiln.convert.quantize.calib import batches

REPORT_FILE = "quant_report.json"
# checkpoint name -> HF name(s); qkv is split back by rows.
HF_LINEARS = {"attention.dense": "self_attn.o_proj", "mlp.fc": "mlp.gate_proj",
              "mlp.gate": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}


@torch.no_grad()
def compare(ref_model, quant_model, windows: list[torch.Tensor], batch_size: int = 8) -> dict:
    nll_ref = nll_q = kl = 0.0
    agree = count = 0
    for batch in batches(windows, batch_size):
        inputs, targets = batch[:, :-1], batch[:, 1:].flatten()
        ref = torch.log_softmax(ref_model(input_ids=inputs).logits.float().flatten(0, 1), -1)
        q = torch.log_softmax(quant_model(input_ids=inputs).logits.float().flatten(0, 1), -1)
        nll_ref -= ref.gather(1, targets[:, None]).sum().item()
        nll_q -= q.gather(1, targets[:, None]).sum().item()
        kl += (ref.exp() * (ref - q)).sum().item()
        agree += (ref.argmax(-1) == q.argmax(-1)).sum().item()
        count += targets.numel()
    ppl_ref, ppl_q = math.exp(nll_ref / count), math.exp(nll_q / count)
    return {"perplexity_ref": ppl_ref, "perplexity_quant": ppl_q,
            "perplexity_increase_pct": 100 * (ppl_q / ppl_ref - 1),
            "kl_divergence_mean": kl / count, "top1_agreement": agree / count, "eval_tokens": count}


def hf_linears(layer) -> dict[str, list[torch.nn.Module]]:
    """A HF decoder layer's linears by checkpoint name (qkv: the q, k and v projections, in order)."""
    attn = layer.self_attn
    return {"attention.qkv": [attn.q_proj, attn.k_proj, attn.v_proj],
            **{name: [layer.get_submodule(hf)] for name, hf in HF_LINEARS.items()}}


def load_dequantized(model, tensors: dict[str, torch.Tensor], quant_algo: str, group_size: int,
                     num_layers: int) -> None:
    """Replace `model`'s linear weights with what the checkpoint tensors dequantize to (with any
    pre-quant scales among them folded in)."""
    from kiln.convert.quantize.rtn import dequantize_linear

    for i in range(num_layers):
        prefix = f"transformer.layers.{i}."
        for name, modules in hf_linears(model.model.layers[i]).items():
            parts = {k[len(prefix + name) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + name + ".")}
            weight = dequantize_linear(parts, quant_algo, group_size)
            for module, rows in zip(modules, weight.split([m.weight.shape[0] for m in modules])):
                module.weight.data.copy_(rows)


def summary_lines(report: dict) -> list[str]:
    what = report["qformat"] or "unquantized weights"
    if report["kv_cache_dtype"]:
        what += f" + {report['kv_cache_dtype']} KV cache"
    r = report
    return [
        f"accuracy of {what} ({r['quant_algo'] or '-'}/{r['kv_cache_quant_algo'] or '-'}) on "
        f"{r['eval_tokens']:,} tokens, {r['eval_source']}:",
        f"  perplexity {r['perplexity_ref']:.3f} -> {r['perplexity_quant']:.3f} "
        f"({r['perplexity_increase_pct']:+.2f}%), mean KL {r['kl_divergence_mean']:.5f}, "
        f"top-1 agreement {100 * r['top1_agreement']:.2f}%",
    ]


def write_report(report: dict, checkpoint_dir: Path) -> Path:
    path = Path(checkpoint_dir) / REPORT_FILE
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
