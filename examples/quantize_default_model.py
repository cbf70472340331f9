"""Quantizes Kiln's default model (models/kiln-tiny-stdlib) in every format and prints the accuracy
table: calibration on the model's training files, evaluation on its held-out files (the split of
examples/train_default_model.py, which the model card lists).

    python examples/quantize_default_model.py --group_size 64 --out /tmp/quant-default

The model's intermediate size (704) is not a multiple of 128, so the int4 formats need a group size
that divides both 256 and 704: 64, 32 or 16.
"""
import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = [  # (qformat, kv_cache_dtype)
    ("int8_wo", None), ("fp8", None), ("int8_sq", None), ("int4_wo", None), ("int4_awq", None),
    ("int4_gptq", None), ("w4a8_awq", None),
    ("int8_wo", "fp8"), ("int8_wo", "int8"), ("fp8", "fp8"), ("fp8", "int8"), (None, "fp8"), (None, "int8"),
]


def default_split() -> tuple[list[Path], list[Path]]:
    spec = importlib.util.spec_from_file_location("train_default_model", ROOT / "examples" / "train_default_model.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    _, files = train.stdlib_files()
    return train.split(files)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", type=Path, default=ROOT / "models" / "kiln-tiny-stdlib")
    p.add_argument("--out", type=Path, required=True, help="one checkpoint dir per run is written under it")
    p.add_argument("--group_size", type=int, default=64)
    p.add_argument("--calib_size", type=int, default=512)
    p.add_argument("--seq_len", type=int, default=256, help="the model's training context")
    p.add_argument("--eval_size", type=int, default=0, help="evaluation windows; 0: all held-out text")
    p.add_argument("--only", nargs="*", help="qformat[+kv] runs to do, e.g. int4_awq int8_wo+fp8")
    args = p.parse_args()

    from kiln.convert.cli import convert_checkpoint
    from kiln.convert.quantize.pipeline import QuantOptions

    train_files, held_out = default_split()
    rows = []
    for qformat, kv in RUNS:
        name = "+".join(x for x in (qformat or "none", kv) if x)
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        opts = QuantOptions(qformat, kv, args.group_size, train_files, args.calib_size, args.seq_len,
                            held_out, args.eval_size)
        out = convert_checkpoint(args.model_dir, args.out / name, quant=opts,
                                 log=lambda m: print(f"  {m}", file=sys.stderr))
        r = json.loads((out / "quant_report.json").read_text())
        rows.append({"run": name, **r, "wall_s": round(time.perf_counter() - start, 1)})
        print(f"{name}: ppl {r['perplexity_ref']:.3f} -> {r['perplexity_quant']:.3f} "
              f"({r['perplexity_increase_pct']:+.2f}%)", file=sys.stderr)

    print(f"| qformat | KV | group | ppl fp32 | ppl quant | increase | mean KL | top-1 | time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['qformat'] or '-'} | {r['kv_cache_dtype'] or '-'} | {r['group_size'] or '-'} "
              f"| {r['perplexity_ref']:.3f} | {r['perplexity_quant']:.3f} | "
              f"{r['perplexity_increase_pct']:+.2f}% | {r['kl_divergence_mean']:.5f} | "
              f"{100 * r['top1_agreement']:.2f}% | {r['wall_s']:.0f}s |")
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
