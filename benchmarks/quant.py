"""Quantized engines against the unquantized one, in one run: size, KV bytes per token, speed, accuracy.

For each format it converts (`convert_checkpoint` with --qformat / --kv_cache_dtype), builds an engine
with the same build config, and measures engine size, KV cache bytes per token, decode tokens/s at
batch 1 and 16, prefill tokens/s of one prompt, and the ratios to the unquantized engine; the
accuracy columns come from the converter's report (quant_report.json).

  # the default model, calibrated on its training files and evaluated on its held-out files
  python benchmarks/quant.py --model default --group_size 64
  # a mixture of experts trained the same way (examples/train_default_model.py --experts 8)
  python benchmarks/quant.py --model bench_out/moe-stdlib --stdlib_data --formats none int8_wo int4_wo fp8
  # SmolLM-135M's shape with random weights (speed and size only: its accuracy means nothing)
  python benchmarks/quant.py --model smollm --formats none int8_wo int4_awq fp8
"""
import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ["none", "int8_wo", "int4_wo", "int4_awq", "int4_gptq", "fp8", "int8_sq", "w4a8_awq",
           "int8_wo+fp8", "int8_wo+int8"]


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def datasets(model: str, work: Path, vocab: int, stdlib: bool = False) -> tuple[list[Path], list[Path]]:
    """(calibration files, evaluation files): the default model's training and held-out files (also
    for another model trained by examples/train_default_model.py, with stdlib), else random words."""
    if model == "default" or stdlib:
        return load_module(ROOT / "examples" / "quantize_default_model.py", "quantize_default").default_split()
    # The random model's tokenizer knows only the words t0 .. t{vocab-1}.
    g = torch.Generator().manual_seed(0)
    files = []
    for name in ("calib.txt", "eval.txt"):
        path = work / name
        ids = torch.randint(3, vocab, (64, 256), generator=g).tolist()
        path.write_text("\n".join(" ".join(f"t{i}" for i in row) for row in ids))
        files.append([path])
    return files[0], files[1]


INT8_ACT_KERNELS = ("avx512_vnni", "avx2_int8", "portable_int8")


def engine_perplexity(engine_dir: Path, files: list[Path], chars: int, kernel: str | None = None) -> float:
    """Perplexity through the engine (kiln.runtime.frontend.perplexity, windows of 256 tokens) of the first
    `chars` characters of the evaluation files; kernel: every GEMM forced onto it (KILN_GEMM_KERNEL,
    in a subprocess), so that int8 activations are scored at every token count, not only where the
    tactics picked them."""
    if kernel is not None:
        code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import quant; "
                "print(quant.engine_perplexity(Path(sys.argv[2]), [Path(f) for f in sys.argv[4:]], int(sys.argv[3])))")
        out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(engine_dir), str(chars),
                              *map(str, files)], env={**os.environ, "KILN_GEMM_KERNEL": kernel},
                             capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])
    from kiln import LLM
    from kiln.runtime.frontend.perplexity import perplexity

    text = "".join(Path(f).read_text() for f in files)[:chars]
    return perplexity(LLM(engine_dir), [text], 256).perplexity


def int8_kernel_here() -> str:
    from kiln.plugins import tactics

    have = set(tactics.cpu_features())
    return next(k for k, need in zip(INT8_ACT_KERNELS, ("avx512_vnni", "avx2", None)) if need is None or need in have)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default, smollm, or an HF model dir")
    ap.add_argument("--stdlib_data", action="store_true",
                    help="the model was trained by examples/train_default_model.py (e.g. with --experts): "
                         "calibrate and evaluate on its training and held-out files")
    ap.add_argument("--formats", nargs="+", default=FORMATS, help="qformat[+kv_cache_dtype] runs; 'none' is bf16")
    ap.add_argument("--group_size", type=int, default=64)
    ap.add_argument("--calib_size", type=int, default=128)
    ap.add_argument("--work_dir", type=Path, default=Path("bench_out/quant"))
    ap.add_argument("--max_batch_size", type=int, default=16)
    ap.add_argument("--input_len", type=int, default=128)
    ap.add_argument("--output_len", type=int, default=64)
    ap.add_argument("--prefill_len", type=int, default=256)
    ap.add_argument("--reuse", action="store_true", help="measure engines already built in --work_dir again")
    ap.add_argument("--rebuild", action="store_true",
                    help="reuse the checkpoints in --work_dir, build their engines again (after an engine change)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time each engine this many times and keep the fastest (a shared machine's noise "
                         "only ever slows a run down)")
    ap.add_argument("--int8_activations", action=argparse.BooleanOptionalAction, default=True,
                    help="build the int8/int4 engines with engine-build's --int8_activations (its default) and report "
                         "their perplexity with int8 activations and with float activations at every token count "
                         "beside the engine's own mix (--no-int8_activations: W8A16/W4A16 engines, float only)")
    ap.add_argument("--quantize_lm_head", choices=["auto", "none", "int8", "int4"], default="auto",
                    help="engine-build --quantize_lm_head (auto: int8 for the int8/int4 weight-only formats)")
    ap.add_argument("--ppl_chars", type=int, default=40000,
                    help="characters of the evaluation text scored through each engine (0: skip)")
    ap.add_argument("--timing_cache", help="engine-build --timing_cache FILE")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(load_module(Path(__file__).parent / "throughput.py", "throughput").cpu_banner())

    from kiln import LLM
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig
    from kiln.convert.cli import convert_checkpoint
    from kiln.convert.quantize.pipeline import QuantOptions
    from kiln.plugins import tactics

    bench = load_module(Path(__file__).parent / "throughput.py", "throughput")
    work = args.work_dir / (Path(args.model).name if args.model not in ("default", "smollm") else args.model)
    work.mkdir(parents=True, exist_ok=True)
    if args.model == "default":
        hf_dir = ROOT / "models" / "kiln-tiny-stdlib"
    elif args.model == "smollm":
        hf_dir = bench.make_model(work / "hf", torch.bfloat16)
    else:
        hf_dir = Path(args.model)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    calib, evaluation = datasets(args.model, work, vocab, args.stdlib_data)
    seq_len = args.input_len + args.output_len
    build = dict(max_batch_size=args.max_batch_size, max_input_len=max(args.input_len, args.prefill_len),
                 max_seq_len=max(seq_len, args.prefill_len + 1),
                 max_num_tokens=max(args.max_batch_size * args.input_len, args.prefill_len))

    def best(measure):
        return max(measure() for _ in range(args.repeats))

    rows = []
    for run in args.formats:
        qformat, _, kv = run.partition("+")
        qformat = None if qformat == "none" else qformat
        quant = QuantOptions(qformat, kv or None, args.group_size, calib, args.calib_size, 256, evaluation, 64)
        ckpt, engine_dir = work / f"ckpt_{run}", work / f"engine_{run}"
        convert_s = build_s = None
        if not (args.reuse and (engine_dir / "config.json").exists()):
            if not (args.rebuild and (ckpt / "config.json").exists()):
                start = time.perf_counter()
                convert_checkpoint(hf_dir, ckpt, dtype="bfloat16", quant=quant if quant.enabled else None,
                                   log=lambda m: print(f"  {m}", file=sys.stderr))
                convert_s = time.perf_counter() - start
            shutil.rmtree(engine_dir, ignore_errors=True)
            start = time.perf_counter()
            int8 = args.int8_activations and qformat in ("int8_wo", "int4_wo", "int4_awq", "int4_gptq")
            build_engine(ckpt, engine_dir, BuildConfig(**build, int8_activations=int8, timing_cache=args.timing_cache,
                                                       quantize_lm_head=args.quantize_lm_head),
                         log=lambda m: print(f"  {m}", file=sys.stderr))
            build_s = time.perf_counter() - start
        llm = LLM(engine_dir)
        engine = llm.llm_engine.core.executor.engine
        report_path = ckpt / "quant_report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        rows.append(dict(
            run=run, convert_s=convert_s, build_s=build_s,
            engine_mb=sum(f.stat().st_size for f in engine_dir.iterdir()) / 2**20,
            kv_bytes_per_token=engine.bytes_per_block // llm.llm_engine.build_config.tokens_per_block,
            decode_b1=best(lambda: bench.time_kiln(llm, 1, args.input_len, args.output_len, vocab)),
            decode_b16=best(lambda: bench.time_kiln(llm, args.max_batch_size, args.input_len, args.output_len, vocab)),
            prefill=best(lambda: bench.prefill_kiln(llm, args.prefill_len, vocab)),
            ppl_increase_pct=report.get("perplexity_increase_pct"), top1=report.get("top1_agreement"),
        ))
        if args.ppl_chars:
            rows[-1]["engine_ppl"] = engine_perplexity(engine_dir, evaluation, args.ppl_chars)
            if args.int8_activations and qformat in ("int8_wo", "int4_wo", "int4_awq", "int4_gptq"):
                for key, kernel in (("engine_ppl_int8_act", int8_kernel_here()), ("engine_ppl_float_act", "avx2")):
                    if kernel == "avx2" and "avx2" not in tactics.cpu_features():
                        kernel = "portable"
                    rows[-1][key] = engine_perplexity(engine_dir, evaluation, args.ppl_chars, kernel)
        print(f"{run}: {rows[-1]}", file=sys.stderr)
        del llm, engine

    base = next((r for r in rows if r["run"] == "none"), rows[0])
    print(f"\n{args.model}, group size {args.group_size}, {torch.get_num_threads()} threads; ratios to {base['run']}")
    print("| format | engine MB | KV B/token | decode b1 tok/s | decode b16 tok/s | prefill tok/s | ppl vs bf16 | "
          "engine ppl | engine ppl, float act | engine ppl, int8 act | build s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def cell(key, fmt="{:.1f}"):
            return f"{fmt.format(r[key])} ({r[key] / base[key]:.2f}x)"
        ppl = "-" if r["ppl_increase_pct"] is None else f"{r['ppl_increase_pct']:+.2f}%"
        def ppl_cell(key):
            if key not in r:
                return "-"
            return f"{r[key]:.3f} ({100 * (r[key] / base['engine_ppl'] - 1):+.2f}%)" if "engine_ppl" in base else f"{r[key]:.3f}"
        print(f"| {r['run']} | {cell('engine_mb')} | {cell('kv_bytes_per_token', '{:d}')} | {cell('decode_b1')} | "
              f"{cell('decode_b16')} | {cell('prefill')} | {ppl} | {ppl_cell('engine_ppl')} | "
              f"{ppl_cell('engine_ppl_float_act')} | {ppl_cell('engine_ppl_int8_act')} | {r['build_s'] or 0:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
