"""Compares int4 weight-only quantizers on Kiln's default model at one group size: round-to-nearest
(int4_wo), ModelOpt's AWQ variants (awq_lite, awq_clip, awq_full, with knobs) and GPTQ.

Every variant is scored the same way: the exported checkpoint tensors are dequantized into the HF
model (pre-quant scales folded in, as the engine computes) and compared with the unquantized model
on the held-out windows of examples/quantize_default_model.py's split. Per-window NLL, KL and top-1
counts are saved so that differences between two variants get a paired bootstrap interval over
windows (is a 0.05% perplexity gap distinguishable at all?).

    OMP_NUM_THREADS=1 python benchmarks/awq_algorithms.py --out /tmp/awq --variants rtn lite clip full gptq
    python benchmarks/awq_algorithms.py --out /tmp/awq --table   # the table and intervals vs rtn
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> ModelOpt algorithm (None: round-to-nearest; "gptq": the int4_gptq format's settings)
VARIANTS = {
    "rtn": None,
    "lite": {"method": "awq_lite"},
    "lite_a05": {"method": "awq_lite", "alpha_step": 0.05},
    "clip": {"method": "awq_clip"},
    "clip_t256": {"method": "awq_clip", "max_tokens_per_batch": 256},
    "clip_t256_s02": {"method": "awq_clip", "max_tokens_per_batch": 256, "shrink_step": 0.02},
    "full": {"method": "awq_full"},
    "full_t256": {"method": "awq_full", "max_tokens_per_batch": 256},
    "gptq": "gptq",
}


def default_split():
    spec = importlib.util.spec_from_file_location("qdm", ROOT / "examples" / "quantize_default_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.default_split()


@torch.no_grad()
def per_window(ref_model, quant_model, windows, batch_size=8) -> dict[str, torch.Tensor]:
    from kiln.convert.quantize.calib import batches

    out = {k: [] for k in ("nll_ref", "nll_q", "kl", "agree", "tokens")}
    for batch in batches(windows, batch_size):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        ref = torch.log_softmax(ref_model(input_ids=inputs).logits.float(), -1)
        q = torch.log_softmax(quant_model(input_ids=inputs).logits.float(), -1)
        out["nll_ref"].append(-ref.gather(2, targets[..., None])[..., 0].double().sum(1))
        out["nll_q"].append(-q.gather(2, targets[..., None])[..., 0].double().sum(1))
        out["kl"].append((ref.exp() * (ref - q)).sum(-1).double().sum(1))
        out["agree"].append((ref.argmax(-1) == q.argmax(-1)).double().sum(1))
        out["tokens"].append(torch.full((len(batch),), targets.shape[1], dtype=torch.float64))
    return {k: torch.cat(v) for k, v in out.items()}


def metrics(s: dict[str, torch.Tensor]) -> dict:
    n = s["tokens"].sum()
    ppl_ref, ppl_q = math.exp(s["nll_ref"].sum() / n), math.exp(s["nll_q"].sum() / n)
    return {"ppl_ref": ppl_ref, "ppl_quant": ppl_q, "ppl_increase_pct": 100 * (ppl_q / ppl_ref - 1),
            "kl": float(s["kl"].sum() / n), "top1": float(s["agree"].sum() / n)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", type=Path, default=ROOT / "models" / "kiln-tiny-stdlib")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--group_size", type=int, default=64)
    p.add_argument("--calib_size", type=int, default=128)
    p.add_argument("--eval_size", type=int, default=128)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--variants", nargs="*", default=[], choices=list(VARIANTS))
    p.add_argument("--table", action="store_true", help="print the table of saved runs")
    p.add_argument("--boot", type=int, default=10000, help="bootstrap resamples")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.variants:
        measure(args)
    if args.table:
        table(args)


def measure(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.config import Mapping, torch_dtype
    from kiln.convert.hf import HFWeights
    from kiln.convert.hf_config import pretrained_config_from_hf, read_hf_config
    from kiln.convert.quantize import modelopt as mo
    from kiln.convert.quantize.calib import batches, make_split, read_texts
    from kiln.convert.quantize.formats import FORMATS, linear_prefixes
    from kiln.convert.quantize.report import load_dequantized
    from kiln.convert.quantize.rtn import quantize_linear
    from kiln.convert.shard import rank_plan

    cfg = pretrained_config_from_hf(read_hf_config(args.model_dir), None, 1, 1)
    train_files, held_out = default_split()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    split = make_split(tokenizer, read_texts(train_files), read_texts(held_out, "evaluation"),
                       args.calib_size, args.seq_len, args.eval_size)
    with HFWeights(args.model_dir) as weights:
        base = {n: b(weights) for n, b in rank_plan(dataclasses.replace(cfg, mapping=Mapping()), 0)}

    def load():
        return AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()

    ref = load()
    calib = batches(split.calib, 8)
    for name in args.variants:
        algo = VARIANTS[name]
        start = time.perf_counter()
        fq = None
        if algo is None:
            tensors = {}
            for prefix in linear_prefixes(cfg):
                for suffix, t in quantize_linear(base[prefix + ".weight"], "W4A16", args.group_size).items():
                    tensors[f"{prefix}.{suffix}"] = t
        else:
            qformat = "int4_gptq" if algo == "gptq" else "int4_awq"
            config = mo.modelopt_config(qformat, None, args.group_size)
            if algo != "gptq":
                config["algorithm"] = dict(algo)
            fq = load()
            import modelopt.torch.quantization as mtq

            with mo.quiet(), torch.no_grad():
                mtq.quantize(fq, config, lambda m: [m(input_ids=b) for b in calib])
            with tempfile.TemporaryDirectory() as tmp:
                mo.export(fq, cfg.architecture, cfg.dtype, Path(tmp))
                _, tensors = mo.read_export(Path(tmp), "W4A16_AWQ", cfg.num_hidden_layers,
                                            torch_dtype(cfg.dtype))
        quant_s = time.perf_counter() - start
        pqs = sum(k.endswith("prequant_scaling_factor") for k in tensors)
        deq = load()
        load_dequantized(deq, tensors, "W4A16_AWQ", args.group_size, cfg.num_hidden_layers)
        with mo.quiet():
            s = per_window(ref, deq, split.eval)
        result = {"variant": name, "algorithm": algo, "group_size": args.group_size,
                  "calib_windows": len(split.calib), "eval_windows": len(split.eval),
                  "eval_tokens": int(s["tokens"].sum()), "prequant_tensors": pqs,
                  "quantize_s": round(quant_s, 1), **metrics(s)}
        if fq is not None:  # what quant_report.json measures: ModelOpt's fake-quant model
            with mo.quiet():
                result["fake_quant"] = metrics(per_window(ref, fq, split.eval))
        torch.save(s, args.out / f"{name}.pt")
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result), flush=True)


def table(args) -> None:
    runs = {p.stem: (json.loads(p.read_text()), torch.load(p.with_suffix(".pt")))
            for p in sorted(args.out.glob("*.json"))}
    print("| variant | algorithm | ppl ref -> quant | increase | mean KL | top-1 | pqs | quantize |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (r, _) in runs.items():
        print(f"| {name} | {r['algorithm']} | {r['ppl_ref']:.3f} -> {r['ppl_quant']:.3f} | "
              f"{r['ppl_increase_pct']:+.3f}% | {r['kl']:.5f} | {100 * r['top1']:.2f}% | "
              f"{r['prequant_tensors']} | {r['quantize_s']:.0f}s |")
    if "rtn" not in runs:
        return
    g = torch.Generator().manual_seed(0)
    _, b = runs["rtn"]
    n = len(b["tokens"])
    idx = torch.randint(0, n, (args.boot, n), generator=g)
    print("\npaired bootstrap over eval windows (95% interval, variant - rtn):")
    print("| variant | d ppl increase (pct points) | d mean KL | d top-1 (pct points) |")
    print("|---|---|---|---|")
    for name, (r, a) in runs.items():
        if name == "rtn":
            continue

        def stat(s, i):
            tok = s["tokens"][i].sum(1)
            ppl = 100 * ((s["nll_q"][i].sum(1) - s["nll_ref"][i].sum(1)) / tok).exp()
            return ppl, s["kl"][i].sum(1) / tok, 100 * s["agree"][i].sum(1) / tok

        full = torch.arange(n)[None]
        cols = []
        for da, db, dfa, dfb in zip(stat(a, idx), stat(b, idx), stat(a, full), stat(b, full)):
            d = da - db
            lo, hi = torch.quantile(d, torch.tensor([0.025, 0.975], dtype=d.dtype))
            cols.append(f"{float(dfa - dfb):+.4f} [{float(lo):+.4f}, {float(hi):+.4f}]")
        print(f"| {name} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
