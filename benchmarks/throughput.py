"""Offline generation throughput: Kiln against HF transformers `generate` on the same weights, same run.

By default it makes a random-weight model of SmolLM-135M's shape (hidden 576, 30 layers, 9 heads,
3 KV heads, intermediate 1536, vocab 49152, tied embeddings), converts and builds it, then measures
  - decode tokens/s at each --batch size (prompts of --input_len tokens, --output_len new tokens),
  - prefill tokens/s of one --prefill_len prompt,
for Kiln and for HF, and prints the ratios; and how long loading the engine took, and what it wrote.
Prompts are random token ids of equal length, so HF's batched generate needs no padding.

With --tp N / --pp M (or --parallel TPxPP ...) it also builds those multi-rank engines of the same
weights and measures each against the single-rank engine in the same run, with the cost of one
all-reduce of the hidden state (shared memory and gloo, benchmarks/all_reduce.py) and each rank's
build time and peak RSS. --shape llama-1b uses Llama-3.2-1B's shape instead of SmolLM-135M's, and
--build_only stops after the builds.

  python benchmarks/throughput.py --batch 1 16 --output_len 128 --json out.json
  python benchmarks/throughput.py --tp 2 --pp 2 --skip_hf --long_context 0
  python benchmarks/throughput.py --shape llama-1b --tp 2 --build_only --skip_hf
"""
import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

SMOLLM_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                   tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
                   bos_token_id=0, eos_token_id=0)
LLAMA_1B = dict(SMOLLM_135M, vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
SHAPES = {"smollm-135m": SMOLLM_135M, "llama-1b": LLAMA_1B}


def make_model(out: Path, dtype: torch.dtype, shape: dict = SMOLLM_135M) -> Path:
    """A random Llama of the given shape, with a word-level tokenizer covering its whole vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (out / "config.json").exists():
        return out
    config = LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(dtype).save_pretrained(out, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t0").save_pretrained(out)
    return out


def bytes_written() -> int | None:
    """What this process has written to storage so far (Linux /proc/self/io), else None."""
    try:
        return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def time_kiln(llm, batch, input_len, output_len, vocab):
    from kiln import SamplingParams

    ids = [{"prompt_token_ids": p} for p in prompts(batch, input_len, vocab)]
    llm.generate(ids[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    total = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return batch * (output_len - 1) / max(total - prefill, 1e-9)


def decode_kiln(llm, batch, input_len, output_len, vocab):
    """Decode tokens/s of `batch` requests prefilled together: their tokens after the first over the
    time from the first first token to the last finish (no prefill time subtracted)."""
    from kiln import SamplingParams

    ids = [{"prompt_token_ids": p} for p in prompts(batch, input_len, vocab)]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    start = min(o.metrics.first_token_time for o in outs)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (max(o.metrics.finished_time for o in outs) - start)


def time_hf(model, batch, input_len, output_len, vocab):
    ids = torch.tensor(prompts(batch, input_len, vocab))

    def generate(x, n):
        return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0,
                              max_new_tokens=n, min_new_tokens=n)

    with torch.inference_mode():
        generate(ids[:1], 4)  # warm-up
        start = time.perf_counter()
        generate(ids, 1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        generate(ids, output_len)
        total = time.perf_counter() - start
    return batch * (output_len - 1) / max(total - prefill, 1e-9)


def prefill_kiln(llm, length, vocab, repeats=3):
    from kiln import SamplingParams

    ids = [{"prompt_token_ids": prompts(1, length, vocab, seed=1)[0]}]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(ids, params)
    start = time.perf_counter()
    for _ in range(repeats):
        llm.generate(ids, params)
    return length * repeats / (time.perf_counter() - start)


def prefill_hf(model, length, vocab, repeats=3):
    ids = torch.tensor(prompts(1, length, vocab, seed=1))
    with torch.inference_mode():
        model(ids)
        start = time.perf_counter()
        for _ in range(repeats):
            model(ids, use_cache=False)
    return length * repeats / (time.perf_counter() - start)


def decode_seconds_at(llm, context, vocab, new_tokens=33):
    """Seconds per decoded token of one sequence whose context is `context` tokens long."""
    from kiln import SamplingParams

    ids = [{"prompt_token_ids": prompts(1, context, vocab, seed=2)[0]}]
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    return out.metrics.time_per_output_token


def mixed_step(engine, vocab, prefill_len=512, num_decodes=15, input_len=128, repeats=3):
    """Seconds of one step holding a prefill_len prefill and num_decodes decodes, against a step with
    the prefill alone and a decode step at batch num_decodes: (mixed, prefill, decode)."""
    from kiln import SamplingParams

    def timed_step():
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    long_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    long_prompt = {"prompt_token_ids": prompts(1, prefill_len, vocab, seed=3)[0]}
    prefill = []
    for _ in range(repeats + 1):  # the first is a warm-up
        engine.add_request(long_prompt, long_params)
        prefill.append(timed_step())
    params = SamplingParams(temperature=0, max_tokens=4 * repeats + 8, ignore_eos=True)
    decoders = [engine.add_request({"prompt_token_ids": p}, params)
                for p in prompts(num_decodes, input_len, vocab, seed=4)]
    engine.step()  # their prefill: from here on they decode
    decode, mixed = [], []
    for _ in range(repeats + 1):
        decode.append(timed_step())
        rid = engine.add_request(long_prompt, long_params)
        mixed.append(timed_step())
        engine.abort(rid)
    for rid in decoders:
        engine.abort(rid)
    median = lambda xs: sorted(xs[1:])[len(xs[1:]) // 2]  # noqa: E731
    return median(mixed), median(prefill), median(decode)


def mapping(text: str) -> tuple[int, int]:
    tp, _, pp = text.partition("x")
    return int(tp), int(pp or 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf_dir", type=Path, help="HF model dir to use instead of a random one of --shape")
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm-135m", help="the random model's shape")
    ap.add_argument("--work_dir", type=Path, default=Path("bench_out/throughput"),
                    help="where the model, checkpoint and engine are kept (reused when present)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--backend", default="aoti", choices=["aoti", "eager"])
    ap.add_argument("--max_autotune", action=argparse.BooleanOptionalAction, default=None,
                    help="AOTInductor max-autotune (default: engine-build's, i.e. on for bf16/fp16)")
    ap.add_argument("--attention", choices=["inline", "cpp"], default=None,
                    help="paged attention traced inline or the C++ plugin (default: engine-build's)")
    ap.add_argument("--gemm", choices=["inline", "cpp"], default=None,
                    help="GEMMs on ATen / Inductor or the C++ GEMM plugin (default: engine-build's)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the engine even if one exists")
    ap.add_argument("--tp", type=int, default=None, help="also measure a tensor-parallel engine of this size")
    ap.add_argument("--pp", type=int, default=None, help="also measure a pipeline-parallel engine of this size")
    ap.add_argument("--parallel", type=mapping, nargs="*", default=[],
                    help="also measure these multi-rank engines, as TPxPP (2x1, 1x2, 2x2)")
    ap.add_argument("--build_workers", type=int, default=None,
                    help="ranks a multi-rank build compiles at once (default: all of them)")
    ap.add_argument("--build_only", action="store_true", help="stop after building the engines")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input_len", type=int, default=128)
    ap.add_argument("--output_len", type=int, default=128)
    ap.add_argument("--prefill_len", type=int, default=512)
    ap.add_argument("--long_context", type=int, default=4096,
                    help="batch-1 decode is also timed at this context length, against --input_len (0: skip)")
    ap.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=True,
                    help="measure memory bandwidth and report batch-1 decode as a fraction of it")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time each decode this many times, Kiln and HF alike, and keep the fastest "
                         "(a shared machine's noise only ever slows a run down)")
    ap.add_argument("--skip_hf", action="store_true")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    import transformers

    from kiln import LLM
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig
    from kiln.convert.cli import convert_checkpoint
    from kiln.utils import cpu_summary

    print(cpu_summary(), file=sys.stderr)
    print(f"load average at the start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", file=sys.stderr)
    parallel = list(dict.fromkeys(args.parallel + ([(args.tp, 1)] if args.tp else []) + ([(1, args.pp)] if args.pp else [])))
    parallel = [m for m in parallel if m != (1, 1)]
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = args.hf_dir or make_model(work / ("hf" if args.shape == "smollm-135m" else f"hf_{args.shape}"), dtype,
                                       SHAPES[args.shape])
    suffix = {None: "", True: "_autotune", False: "_noautotune"}[args.max_autotune]
    if args.attention:
        suffix += f"_{args.attention}"
    if args.gemm:
        suffix += f"_gemm{args.gemm}"
    if args.shape != "smollm-135m" and not args.hf_dir:
        suffix += f"_{args.shape}"
    max_batch = max(args.batch)
    builds = {}

    def engine_for(tp: int, pp: int) -> Path:
        label = "" if (tp, pp) == (1, 1) else f"_tp{tp}pp{pp}"
        engine_dir = work / f"engine_{args.backend}_{args.dtype}{suffix}{label}"
        if args.rebuild or not (engine_dir / "config.json").exists():
            ckpt = convert_checkpoint(hf_dir, work / f"ckpt_{args.dtype}{suffix}{label}", dtype=args.dtype,
                                      tp_size=tp, pp_size=pp)
            longest = max(args.input_len, args.prefill_len, args.long_context)
            build = BuildConfig(max_batch_size=max(max_batch, 2), max_input_len=longest,
                                max_seq_len=max(args.input_len + args.output_len, longest + 64),
                                max_num_tokens=max(max_batch * args.input_len, longest),
                                tokens_per_block=32, backend=args.backend, max_autotune=args.max_autotune)
            if args.attention:
                build.plugin_config["gpt_attention_plugin"] = args.attention
            if args.gemm:
                build.plugin_config["gemm_plugin"] = args.gemm
            ranks = []
            start = time.perf_counter()
            build_engine(ckpt, engine_dir, build, workers=args.build_workers or tp * pp,
                         log=lambda m: (print(m, file=sys.stderr), ranks.append(m) if m.startswith("rank ") else None))
            builds[(tp, pp)] = {"seconds": time.perf_counter() - start, "ranks": ranks,
                                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        return engine_dir

    engine_dir = engine_for(1, 1)
    parallel_dirs = {m: engine_for(*m) for m in parallel}
    build_seconds = builds.get((1, 1), {}).get("seconds")
    build_rss_mb = builds.get((1, 1), {}).get("peak_rss_mb")
    if args.build_only:
        for (tp, pp), b in builds.items():
            print(f"engine build tp {tp} x pp {pp}: {b['seconds']:.1f}s" + "".join(f"\n  {r}" for r in b["ranks"]))
        return

    written = bytes_written()
    start = time.perf_counter()
    llm = LLM(engine_dir)
    load = {"seconds": time.perf_counter() - start, "mb_written": (bytes_written() - written) / 2**20
            if written is not None else None}
    vocab = llm.llm_engine.model_config.vocab_size
    results = {"engine": str(engine_dir), "build_seconds": build_seconds, "load": load,
               "threads": torch.get_num_threads(), "decode": {}, "prefill": {}}
    hf = None
    if not args.skip_hf:
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    for batch in args.batch if not parallel else []:  # with --parallel the comparison below measures it
        ours = max(time_kiln(llm, batch, args.input_len, args.output_len, vocab) for _ in range(args.repeats))
        theirs = max(time_hf(hf, batch, args.input_len, args.output_len, vocab)
                     for _ in range(args.repeats)) if hf else None
        results["decode"][batch] = {"kiln": ours, "hf": theirs}
    if not parallel:
        ours = prefill_kiln(llm, args.prefill_len, vocab)
        theirs = prefill_hf(hf, args.prefill_len, vocab) if hf else None
        results["prefill"][args.prefill_len] = {"kiln": ours, "hf": theirs}
    if args.long_context:
        short = decode_seconds_at(llm, args.input_len, vocab)
        long = decode_seconds_at(llm, args.long_context, vocab)
        results["long_context"] = {"context": args.long_context, "short_s": short, "long_s": long}
    if args.prefill_len + 15 <= llm.llm_engine.core.scheduler.max_num_tokens and max_batch >= 16 and not parallel:
        mixed, pre, dec = mixed_step(llm.llm_engine, vocab, args.prefill_len, 15, args.input_len)
        results["mixed_step"] = {"mixed_s": mixed, "prefill_s": pre, "decode15_s": dec}
    if args.roofline:
        sys.path.insert(0, str(Path(__file__).parent))
        from roofline import bandwidth, decode_bytes_per_token

        threads = results["threads"]
        roof = max(v for t in sorted({1, threads}) for v in bandwidth(1.0, t).values())
        torch.set_num_threads(threads)
        moved = decode_bytes_per_token(llm.llm_engine.core.executor.engine, args.input_len + args.output_len // 2)
        if results["decode"]:
            results["roofline"] = {"gb_s": roof,
                                   "batch1_gb_s": moved * results["decode"][min(args.batch)]["kiln"] / 1e9}

    def measure(engine, entry):  # the multi-rank comparison: every engine measured the same way
        for batch in args.batch:
            entry["decode"][batch] = max(decode_kiln(engine, batch, args.input_len, args.output_len, vocab)
                                         for _ in range(args.repeats))
        entry["prefill"][args.prefill_len] = max(prefill_kiln(engine, args.prefill_len, vocab)
                                                 for _ in range(args.repeats))
        return entry

    results["parallel"] = {}
    if parallel:
        results["parallel"]["1x1"] = measure(llm, {"engine": str(engine_dir), "decode": {}, "prefill": {}})
    llm.llm_engine.shutdown()
    del llm
    for (tp, pp), pdir in parallel_dirs.items():
        start = time.perf_counter()
        plm = LLM(pdir)
        results["parallel"][f"{tp}x{pp}"] = measure(plm, {"engine": str(pdir), "load_seconds": time.perf_counter() - start,
                                                          "decode": {}, "prefill": {}, "build": builds.get((tp, pp))})
        plm.llm_engine.shutdown()
        del plm
    if any(tp > 1 for tp, _ in parallel):
        sys.path.insert(0, str(Path(__file__).parent))
        import all_reduce

        p = json.loads((engine_dir / "config.json").read_text())["pretrained_config"]
        results["all_reduce"] = all_reduce.run(p["hidden_size"], sorted({*args.batch, args.prefill_len}), args.dtype)
    results["load_average_end"] = os.getloadavg()[0]

    def row(label, r):
        ratio = f"{r['kiln'] / r['hf']:.2f}x" if r["hf"] else "-"
        hf_s = f"{r['hf']:.1f}" if r["hf"] else "-"
        print(f"{label:<32} {r['kiln']:>10.1f} {hf_s:>10} {ratio:>8}")

    print(f"{'tokens/s (' + args.dtype + ', ' + str(results['threads']) + ' threads)':<32} "
          f"{'kiln':>10} {'hf':>10} {'ratio':>8}")
    for batch, r in results["decode"].items():
        row(f"decode batch {batch} ({args.input_len}+{args.output_len})", r)
    for length, r in results["prefill"].items():
        row(f"prefill {length} tokens", r)
    if "long_context" in results:
        r = results["long_context"]
        print(f"batch-1 decode at {r['context']} tokens of context: {r['long_s'] * 1e3:.1f} ms/token, "
              f"{r['long_s'] / r['short_s']:.2f}x the {args.input_len}-token context's {r['short_s'] * 1e3:.1f} ms")
    if "mixed_step" in results:
        r = results["mixed_step"]
        print(f"mixed step ({args.prefill_len}-token prefill + 15 decodes): {r['mixed_s'] * 1e3:.1f} ms = "
              f"{r['mixed_s'] / (r['prefill_s'] + r['decode15_s']):.2f}x (prefill alone "
              f"{r['prefill_s'] * 1e3:.1f} ms + decode step at batch 15 {r['decode15_s'] * 1e3:.1f} ms)")
    if "roofline" in results:
        r = results["roofline"]
        print(f"roofline: {r['gb_s']:.1f} GB/s; batch-{min(args.batch)} decode moves {r['batch1_gb_s']:.1f} GB/s "
              f"= {r['batch1_gb_s'] / r['gb_s']:.0%}")
    if results["parallel"]:
        labels = [m for m in results["parallel"] if m != "1x1"]
        one = results["parallel"]["1x1"]
        print(f"{'tokens/s against one rank':<32} {'tp1':>10} " + " ".join(f"{'tp' + m.replace('x', ' pp'):>16}"
                                                                       for m in labels))
        measures = [(f"decode batch {b} ({args.input_len}+{args.output_len})", one["decode"][b], "decode", b)
                    for b in args.batch]
        measures.append((f"prefill {args.prefill_len} tokens", one["prefill"][args.prefill_len], "prefill",
                         args.prefill_len))
        for label, base, kind, key in measures:
            cells = []
            for m in labels:
                v = results["parallel"][m][kind][key]
                cells.append(f"{v:>9.1f} {v / base:>5.2f}x")
            print(f"{label:<32} {base:>10.1f} " + " ".join(f"{c:>16}" for c in cells))
        for m in labels:
            e = results["parallel"][m]
            print(f"tp {m.replace('x', ' x pp ')}: load {e['load_seconds']:.1f}s" + (
                f", build {e['build']['seconds']:.1f}s ({'; '.join(e['build']['ranks'])})" if e["build"] else ""))
    if "all_reduce" in results:
        r = results["all_reduce"]
        print("one all-reduce of [tokens, hidden] between 2 ranks: " + ", ".join(
            f"{t} tokens shm {r['shm'][t] * 1e6:.0f} us / gloo {r['gloo'][t] * 1e6:.0f} us" for t in sorted(r["shm"])))
    print(f"load average at the end: {results['load_average_end']:.1f}")
    ranks_mb = sum(f.stat().st_size for f in engine_dir.glob("rank*.engine")) / 2**20
    written = f", {load['mb_written']:.0f} MB written" if load["mb_written"] is not None else ""
    print(f"engine load (until the first request can run): {load['seconds']:.1f}s{written}, "
          f"for {ranks_mb:.0f} MB of rank engines")
    if build_seconds is not None:
        autotune = json.loads((engine_dir / "config.json").read_text())["build_config"]["max_autotune"]
        size = sum(f.stat().st_size for f in engine_dir.iterdir()) / 2**20
        print(f"engine build: {build_seconds:.1f}s, peak RSS {build_rss_mb:.0f} MB, {size:.0f} MB "
              f"({args.backend}{', max-autotune' if autotune else ''})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
