"""Offline generation throughput: Kiln against HF transformers `generate` (and llama.cpp) on the same weights, same run.

By default it makes a random-weight model of SmolLM-135M's shape (hidden 576, 30 layers, 9 heads,
3 KV heads, intermediate 1536, vocab 49152, tied embeddings), converts and builds it, then measures
  - decode tokens/s at each --batch size (prompts of --input_len tokens, --output_len new tokens),
  - prefill tokens/s of one --prefill_len prompt,
for Kiln and for HF, and prints the ratios. Prompts are random token ids of equal length, so HF's
batched generate needs no padding. --formats adds Kiln's weight-only int8/int4 engines (RTN,
--group_size); --llama_cpp measures llama.cpp at bf16, q8_0 and q4_0 on the same weights
(benchmarks/llama_cpp_bench.py says how to install it). It prints the CPU and its ISA flags first.

  python benchmarks/throughput.py --batch 1 16 --output_len 128 --json out.json
  python benchmarks/throughput.py --formats bf16 int8_wo int4_wo --llama_cpp --int8_activations --batch 1 16
"""
import argparse
import json
import os
import platform
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


ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd", "sve")


def cpu_banner() -> str:
    """The CPU model and its ISA flags that matter to the kernels (from /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = set(value.split())
    except OSError:
        pass
    return f"CPU: {model}, {os.cpu_count()} cores; ISA: {' '.join(f for f in ISA_FLAGS if f in flags) or 'none of ' + '/'.join(ISA_FLAGS[:3])}"


def make_model(out: Path, dtype: torch.dtype) -> Path:
    """A random SmolLM-135M-shaped Llama, with a word-level tokenizer covering its whole vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (out / "config.json").exists():
        return out
    config = LlamaConfig(**SMOLLM_135M, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(dtype).save_pretrained(out, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t0").save_pretrained(out)
    return out


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
    decoders = [engine.add_request({"prompt_token_ids": p}, params).request_id
                for p in prompts(num_decodes, input_len, vocab, seed=4)]
    engine.step()  # their prefill: from here on they decode
    decode, mixed = [], []
    for _ in range(repeats + 1):
        decode.append(timed_step())
        rid = engine.add_request(long_prompt, long_params).request_id
        mixed.append(timed_step())
        engine.abort(rid)
    for rid in decoders:
        engine.abort(rid)
    median = lambda xs: sorted(xs[1:])[len(xs[1:]) // 2]  # noqa: E731
    return median(mixed), median(prefill), median(decode)


def llama_cpp_results(hf_dir, work, args, vocab):
    import llama_cpp_bench as lcb

    out = {}
    longest = max(args.input_len + args.output_len, args.prefill_len) + 8
    for kind, path in lcb.gguf_files(hf_dir, work / "llama_cpp").items():
        model = lcb.LlamaCpp(path, torch.get_num_threads(), max(args.batch), longest)
        decode = {b: max(model.decode(prompts(b, args.input_len, vocab), args.output_len - 1)
                         for _ in range(args.repeats)) for b in args.batch}
        pre = args.prefill_len / min(model.prefill(prompts(1, args.prefill_len, vocab, seed=1)[0]) for _ in range(3))
        model.close()
        out[kind] = {"decode": decode, "prefill": pre}
        print(f"llama.cpp {kind}: {out[kind]}", file=sys.stderr)
    return out


def build_kiln(args, hf_dir, work, fmt) -> tuple[Path, float | None, float | None]:
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig
    from kiln.convert.cli import convert_checkpoint
    from kiln.convert.quantize.pipeline import QuantOptions

    suffix = {None: "", True: "_autotune", False: "_noautotune"}[args.max_autotune]
    if args.attention:
        suffix += f"_{args.attention}"
    if args.gemm:
        suffix += f"_gemm{args.gemm}"
    quantized = fmt != "bf16" and fmt != args.dtype
    if quantized:
        suffix += f"_{fmt}_g{args.group_size}"
    suffix += ("_int8act" if args.int8_activations and quantized else "") + ("_qhead" if args.quantize_lm_head else "")
    engine_dir = work / f"engine_{args.backend}_{args.dtype}{suffix}"
    if not args.rebuild and (engine_dir / "config.json").exists():
        return engine_dir, None, None
    ckpt = work / (f"ckpt_{args.dtype}_{fmt}_g{args.group_size}" if quantized else f"ckpt_{args.dtype}")
    if not (ckpt / "config.json").exists():
        quant = QuantOptions(fmt, None, args.group_size, eval_size=0) if quantized else None  # RTN: no calibration
        convert_checkpoint(hf_dir, ckpt, dtype=args.dtype, quant=quant)
    longest = max(args.input_len, args.prefill_len, args.long_context)
    max_batch = max(args.batch)
    build = BuildConfig(max_batch_size=max(max_batch, 2), max_input_len=longest,
                        max_seq_len=max(args.input_len + args.output_len, longest + 64),
                        max_num_tokens=max(max_batch * args.input_len, longest),
                        tokens_per_block=32, backend=args.backend, max_autotune=args.max_autotune,
                        timing_cache=args.timing_cache, int8_activations=args.int8_activations,
                        quantize_lm_head=args.quantize_lm_head)
    if args.attention:
        build.plugin_config["gpt_attention_plugin"] = args.attention
    if args.gemm:
        build.plugin_config["gemm_plugin"] = args.gemm
    start = time.perf_counter()
    build_engine(ckpt, engine_dir, build, log=lambda m: print(m, file=sys.stderr))
    return engine_dir, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf_dir", type=Path, help="HF model dir to use instead of the random SmolLM-135M shape")
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
    ap.add_argument("--formats", nargs="+", default=["bf16"], choices=["bf16", "int8_wo", "int4_wo"],
                    help="Kiln engines to measure: the --dtype one and weight-only int8 / int4 (RTN) ones")
    ap.add_argument("--group_size", type=int, default=32, help="int4 group size (32: llama.cpp's q4_0 block)")
    ap.add_argument("--int8_activations", action="store_true",
                    help="build int8/int4 engines with engine-build --int8_activations")
    ap.add_argument("--quantize_lm_head", action="store_true", help="engine-build --quantize_lm_head")
    ap.add_argument("--timing_cache", help="engine-build --timing_cache FILE")
    ap.add_argument("--llama_cpp", action="store_true",
                    help="also measure llama.cpp (llama-cpp-python built from source) at bf16, q8_0, q4_0")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    import transformers

    from kiln import LLM

    print(cpu_banner())
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = args.hf_dir or make_model(work / "hf", dtype)
    max_batch = max(args.batch)
    engines = {fmt: build_kiln(args, hf_dir, work, fmt) for fmt in args.formats}
    engine_dir, build_seconds, build_rss_mb = engines[args.formats[0]]
    llm = LLM(engine_dir)
    vocab = llm.llm_engine.model_config.vocab_size
    results = {"cpu": cpu_banner(), "engine": str(engine_dir), "build_seconds": build_seconds,
               "threads": torch.get_num_threads(), "decode": {}, "prefill": {}}
    hf = None
    if not args.skip_hf:
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    for batch in args.batch:
        ours = max(time_kiln(llm, batch, args.input_len, args.output_len, vocab) for _ in range(args.repeats))
        theirs = max(time_hf(hf, batch, args.input_len, args.output_len, vocab)
                     for _ in range(args.repeats)) if hf else None
        results["decode"][batch] = {"kiln": ours, "hf": theirs}
    ours = prefill_kiln(llm, args.prefill_len, vocab)
    theirs = prefill_hf(hf, args.prefill_len, vocab) if hf else None
    results["prefill"][args.prefill_len] = {"kiln": ours, "hf": theirs}
    if args.long_context:
        short = decode_seconds_at(llm, args.input_len, vocab)
        long = decode_seconds_at(llm, args.long_context, vocab)
        results["long_context"] = {"context": args.long_context, "short_s": short, "long_s": long}
    if args.prefill_len + 15 <= llm.llm_engine.max_num_tokens and max_batch >= 16:
        mixed, pre, dec = mixed_step(llm.llm_engine, vocab, args.prefill_len, 15, args.input_len)
        results["mixed_step"] = {"mixed_s": mixed, "prefill_s": pre, "decode15_s": dec}
    if args.roofline:
        sys.path.insert(0, str(Path(__file__).parent))
        from roofline import bandwidth, decode_bytes_per_token

        threads = results["threads"]
        roof = max(v for t in sorted({1, threads}) for v in bandwidth(1.0, t).values())
        torch.set_num_threads(threads)
        moved = decode_bytes_per_token(llm.llm_engine.engine, args.input_len + args.output_len // 2)
        results["roofline"] = {"gb_s": roof, "batch1_gb_s": moved * results["decode"][min(args.batch)]["kiln"] / 1e9}

    others = {}
    for fmt in args.formats[1:]:
        other = LLM(engines[fmt][0])
        others[fmt] = {"decode": {b: max(time_kiln(other, b, args.input_len, args.output_len, vocab)
                                         for _ in range(args.repeats)) for b in args.batch},
                       "prefill": prefill_kiln(other, args.prefill_len, vocab), "build_seconds": engines[fmt][1]}
        del other
    results["formats"] = {args.formats[0]: {"decode": {b: r["kiln"] for b, r in results["decode"].items()},
                                            "prefill": results["prefill"][args.prefill_len]["kiln"]}, **others}
    if args.llama_cpp:
        results["llama_cpp"] = llama_cpp_results(hf_dir, work, args, vocab)

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
    if build_seconds is not None:
        autotune = llm.llm_engine.build_config.max_autotune
        size = sum(f.stat().st_size for f in engine_dir.iterdir()) / 2**20
        print(f"engine build: {build_seconds:.1f}s, peak RSS {build_rss_mb:.0f} MB, {size:.0f} MB "
              f"({args.backend}{', max-autotune' if autotune else ''})")
    if len(results["formats"]) > 1 or "llama_cpp" in results:
        print(f"\ntokens/s, {results['threads']} threads | " + " | ".join(f"decode b{b}" for b in args.batch)
              + f" | prefill {args.prefill_len}")
        rows = [(f"Kiln {fmt}" + (" (int8 activations)" if args.int8_activations and fmt != args.formats[0] else ""), r)
                for fmt, r in results["formats"].items()]
        rows += [(f"llama.cpp {kind}", r) for kind, r in results.get("llama_cpp", {}).items()]
        if hf:
            rows.append(("HF " + args.dtype, {"decode": {b: r["hf"] for b, r in results["decode"].items()},
                                              "prefill": results["prefill"][args.prefill_len]["hf"]}))
        for label, r in rows:
            print(f"{label} | " + " | ".join(f"{r['decode'][b]:.1f}" for b in args.batch) + f" | {r['prefill']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
