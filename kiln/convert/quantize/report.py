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


SHARED_LINEARS = {"mlp.shared_expert.fc": "mlp.shared_expert.gate_proj",
                  "mlp.shared_expert.gate": "mlp.shared_expert.up_proj",
                  "mlp.shared_expert.proj": "mlp.shared_expert.down_proj"}


def hf_linears(layer, moe: bool = False) -> dict[str, list[torch.nn.Module]]:
    """A HF decoder layer's linears by checkpoint name (qkv: the q, k and v projections, in order);
    a MoE layer's shared expert instead of the dense MLP (its experts: _load_experts)."""
    attn = layer.self_attn
    if moe:
        others = SHARED_LINEARS if hasattr(_moe_block(layer), "shared_expert") else {}
        others = {"attention.dense": "self_attn.o_proj", **others}
    else:
        others = HF_LINEARS
    return {"attention.qkv": [attn.q_proj, attn.k_proj, attn.v_proj],
            **{name: [layer.get_submodule(hf)] for name, hf in others.items()}}


def is_moe_layer(layer) -> bool:
    """Whether a HF decoder layer is a mixture of experts (Mixtral's block_sparse_moe, the Qwens' mlp)."""
    return hasattr(layer, "block_sparse_moe") or hasattr(getattr(layer, "mlp", None), "experts")


def _moe_block(layer):
    return layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp  # Mixtral in transformers 4


def _load_experts(layer, fc: torch.Tensor, proj: torch.Tensor) -> None:
    """fc [experts, up rows; gate rows] and proj into HF's experts: stacked (transformers 5: gate_up_proj
    with the gate rows first) or one module per expert (transformers 4; Mixtral's w1/w3/w2)."""
    up, gate = fc.chunk(2, dim=1)
    experts = _moe_block(layer).experts
    if hasattr(experts, "gate_up_proj"):
        experts.gate_up_proj.data.copy_(torch.cat([gate, up], dim=1))
        experts.down_proj.data.copy_(proj)
        return
    for e, expert in enumerate(experts):
        names = ("w1", "w3", "w2") if hasattr(expert, "w1") else ("gate_proj", "up_proj", "down_proj")
        for name, w in zip(names, (gate[e], up[e], proj[e])):
            getattr(expert, name).weight.data.copy_(w)


def load_dequantized(model, tensors: dict[str, torch.Tensor], quant_algo: str, group_size: int,
                     num_layers: int) -> None:
    """Replace `model`'s linear weights with what the checkpoint tensors dequantize to (with any
    pre-quant scales among them folded in)."""
    from kiln.convert.quantize.rtn import dequantize_linear

    def dequantized(prefix, name):
        parts = {k[len(prefix + name) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + name + ".")}
        return dequantize_linear(parts, quant_algo, group_size)

    for i in range(num_layers):
        prefix, layer = f"transformer.layers.{i}.", model.model.layers[i]
        moe = is_moe_layer(layer)
        if moe:
            _load_experts(layer, dequantized(prefix, "mlp.fc"), dequantized(prefix, "mlp.proj"))
        for name, modules in hf_linears(layer, moe).items():
            weight = dequantized(prefix, name)
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
