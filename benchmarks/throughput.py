"""Offline generation throughput: Kiln against HF transformers `generate` (and llama.cpp, OpenVINO GenAI, ONNX
Runtime GenAI) on the same weights, same run.

By default it makes a random-weight model of SmolLM-135M's shape (hidden 576, 30 layers, 9 heads,
3 KV heads, intermediate 1536, vocab 49152, tied embeddings), converts and builds it, then measures
  - decode tokens/s at each --batch size (prompts of --input_len tokens, --output_len new tokens),
  - prefill tokens/s of one --prefill_len prompt,
for Kiln and for HF, and prints the ratios; and how long loading the engine took, and what it wrote.
Prompts are random token ids of equal length, so HF's batched generate needs no padding, and every
timed Kiln call gets prompts of its own: a prompt seen before would be served by the prefix cache (a
"prefill" of one block). The share of timed prompt tokens the cache served is printed (0% expected).
It prints the CPU and its ISA flags first. --rounds N measures every Kiln engine and peer N times in turn,
each cell keeping its best round, and prints the memory read bandwidth at each round's start: on a shared
machine it drifts by tens of percent within minutes, which once-each timings minutes apart would
credit to whichever runtime ran in the good minute.

--formats adds Kiln's weight-only int8 / int4 engines of the same weights (RTN, --group_size);
--llama_cpp measures llama.cpp at bf16, q8_0 and q4_0 on the same weights, --openvino OpenVINO GenAI at fp16,
int8 and int4 (sym, group 64), --ort_genai ONNX Runtime GenAI at int4 and int8 (their modules beside this
say how to install them; --peer_python names the venv of the exporters); one table then lists them all,
a row per runtime and format.

With --tp N / --pp M (or --parallel TPxPP ...) it also builds those multi-rank engines of each format
and measures each against its single-rank engine in the same run (every engine's decode timed from the
first token to the last finish; HF is not measured then), with the cost of one all-reduce of the hidden
state (shared memory and gloo, benchmarks/all_reduce.py) and each rank's build time and peak RSS (tp
must divide the KV heads: 3 for SmolLM-135M, 8 for llama-1b).
--shape llama-1b uses Llama-3.2-1B's shape instead of SmolLM-135M's (mixtral-s and qwen3-moe-s: small
mixtures of experts shaped like Mixtral-8x7B and Qwen3-30B-A3B), and --build_only stops after the builds.

  python benchmarks/throughput.py --batch 1 16 --output_len 128 --json out.json
  python benchmarks/throughput.py --formats bf16 int8_wo int4_wo --llama_cpp --batch 1 16
  python benchmarks/throughput.py --formats bf16 int8_wo int4_wo --openvino --ort_genai --llama_cpp \
      --peer_python bench_out/peers/bin/python --rounds 3
  python benchmarks/throughput.py --tp 3 --pp 2 --long_context 0
  python benchmarks/throughput.py --shape llama-1b --tp 2 --build_only
"""
import argparse
import itertools
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from kiln.utils import cpu_summary

cpu_banner = cpu_summary  # the name roofline.py and quant.py print it by

SMOLLM_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                   tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
                   bos_token_id=0, eos_token_id=0)
LLAMA_1B = dict(SMOLLM_135M, vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)
# Mixtures of experts, small but shaped like the published ones: Mixtral-8x7B's 8 experts, top 2, experts
# 3.5x the hidden size and 4:1 GQA; Qwen3-30B-A3B's 128 experts, top 8 renormalized, experts 0.375x the
# hidden size, q/k norm, head_dim 128 (its attention 2x the hidden size).
MIXTRAL_S = dict(config="MixtralConfig", vocab_size=32000, hidden_size=512, intermediate_size=1792,
                 num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                 num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
QWEN3_MOE_S = dict(config="Qwen3MoeConfig", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                   moe_intermediate_size=192, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=128, max_position_embeddings=8192, num_experts=128, num_experts_per_tok=8,
                   norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   bos_token_id=0, eos_token_id=0)
SHAPES = {"smollm-135m": SMOLLM_135M, "llama-1b": LLAMA_1B, "mixtral-s": MIXTRAL_S, "qwen3-moe-s": QWEN3_MOE_S}


def make_model(out: Path, dtype: torch.dtype, shape: dict = SMOLLM_135M) -> Path:
    """A random model of the given shape (a Llama unless it names another config class), with a
    word-level tokenizer covering its whole vocab."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    if (out / "config.json").exists():
        return out
    shape = dict(shape)
    config_cls = getattr(transformers, shape.pop("config", "LlamaConfig"))
    arch = config_cls.__name__.replace("Config", "ForCausalLM")
    config = config_cls(**shape, architectures=[arch])
    torch.manual_seed(0)
    getattr(transformers, arch)(config).to(dtype).save_pretrained(out, safe_serialization=True)
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


_seeds = itertools.count(1000)
cache_share = {"prompt_tokens": 0, "cached_tokens": 0}  # over the timed Kiln calls


def fresh(batch: int, length: int, vocab: int) -> list[dict]:
    """Kiln inputs no earlier call has sent."""
    return [{"prompt_token_ids": p} for p in prompts(batch, length, vocab, seed=next(_seeds))]


def timed(llm, inputs, params, lora_request=None):
    outs = llm.generate(inputs, params, lora_request=lora_request)
    cache_share["prompt_tokens"] += sum(len(o.prompt_token_ids) for o in outs)
    cache_share["cached_tokens"] += sum(o.num_cached_tokens or 0 for o in outs)
    return outs


def time_kiln(llm, batch, input_len, output_len, vocab):
    from kiln import SamplingParams

    llm.generate(fresh(1, input_len, vocab), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    timed(llm, fresh(batch, input_len, vocab), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    outs = timed(llm, fresh(batch, input_len, vocab), SamplingParams(temperature=0, max_tokens=output_len,
                                                                     ignore_eos=True))
    total = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return batch * (output_len - 1) / max(total - prefill, 1e-9)


def decode_kiln(llm, batch, input_len, output_len, vocab, lora_request=None):
    """Decode tokens/s of `batch` requests prefilled together: their tokens after the first over the
    time from the first first token to the last finish (no prefill time subtracted)."""
    from kiln import SamplingParams

    outs = timed(llm, fresh(batch, input_len, vocab), SamplingParams(temperature=0, max_tokens=output_len,
                                                                     ignore_eos=True), lora_request)
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
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

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(fresh(1, length, vocab), params)
    inputs = [fresh(1, length, vocab) for _ in range(repeats)]
    start = time.perf_counter()
    for one in inputs:
        timed(llm, one, params)
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

    out = timed(llm, fresh(1, context, vocab), SamplingParams(temperature=0, max_tokens=new_tokens,
                                                              ignore_eos=True))[0]
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
    prefill = []
    for _ in range(repeats + 1):  # the first is a warm-up
        engine.add_request(fresh(1, prefill_len, vocab)[0], long_params)
        prefill.append(timed_step())
    params = SamplingParams(temperature=0, max_tokens=4 * repeats + 8, ignore_eos=True)
    decoders = [engine.add_request(p, params) for p in fresh(num_decodes, input_len, vocab)]
    engine.step()  # their prefill: from here on they decode
    decode, mixed = [], []
    for _ in range(repeats + 1):
        decode.append(timed_step())
        rid = engine.add_request(fresh(1, prefill_len, vocab)[0], long_params)
        mixed.append(timed_step())
        engine.abort(rid)
    for rid in decoders:
        engine.abort(rid)
    median = lambda xs: sorted(xs[1:])[len(xs[1:]) // 2]  # noqa: E731
    return median(mixed), median(prefill), median(decode)


# --flag: (the name its rows print, its module beside this file: exported(hf_dir, work, python) and the class)
PEERS = {"llama_cpp": ("llama.cpp", "llama_cpp_bench", "LlamaCpp"),
         "openvino": ("OpenVINO GenAI", "openvino_bench", "OpenVino"),
         "ort_genai": ("ORT GenAI", "ort_genai_bench", "OrtGenai")}


def peer_results(flag, hf_dir, work, args, vocab):
    """{kind: {"decode": {batch: tokens/s}, "prefill": tokens/s}} of one peer runtime on hf_dir's weights,
    each kind timed in a process of its own (peer_timing.measure)."""
    import importlib

    from peer_timing import measure

    _, module, cls = PEERS[flag]
    models = importlib.import_module(module).exported(hf_dir, work / flag, args.peer_python)
    out = {}
    longest = max(args.input_len + args.output_len, args.prefill_len) + 8
    for kind, path in models.items():
        seeds = itertools.count(1)
        decode = {b: [prompts(b, args.input_len, vocab, seed=next(seeds)) for _ in range(args.repeats)]
                  for b in args.batch}
        prefill = [prompts(1, args.prefill_len, vocab, seed=next(seeds))[0] for _ in range(3)]
        out[kind] = measure(module, cls, path, torch.get_num_threads(), decode, args.output_len - 1, prefill, longest)
        print(f"{PEERS[flag][0]} {kind}: {out[kind]}", file=sys.stderr)
    return out


def keep_best(entry: dict, measured: dict) -> None:
    """entry's {"decode": {batch: tokens/s}, "prefill": tokens/s}, each the best of itself and measured."""
    decode = entry.setdefault("decode", {})
    for b, v in measured["decode"].items():
        decode[b] = max(decode.get(b, 0.0), v)
    entry["prefill"] = max(entry.get("prefill", 0.0), measured["prefill"])


def mapping(text: str) -> tuple[int, int]:
    tp, _, pp = text.partition("x")
    return int(tp), int(pp or 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf_dir", type=Path, help="HF model dir to use instead of a random one of --shape")
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm-135m", help="the random model's shape")
    ap.add_argument("--work_dir", type=Path, default=Path("bench_out/throughput"),
                    help="where the model, checkpoints and engines are kept (reused when present)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--backend", default="aoti", choices=["aoti", "eager"])
    ap.add_argument("--max_autotune", action=argparse.BooleanOptionalAction, default=None,
                    help="AOTInductor max-autotune (default: engine-build's, i.e. on for bf16/fp16)")
    ap.add_argument("--attention", choices=["inline", "cpp"], default=None,
                    help="paged attention traced inline or the C++ plugin (default: engine-build's)")
    ap.add_argument("--gemm", choices=["inline", "cpp"], default=None,
                    help="GEMMs on ATen / Inductor or the C++ GEMM plugin (default: engine-build's)")
    ap.add_argument("--formats", nargs="+", default=["bf16"], choices=["bf16", "int8_wo", "int4_wo"],
                    help="Kiln engines to measure: bf16 is the --dtype one; int8_wo / int4_wo weight-only (RTN)")
    ap.add_argument("--group_size", type=int, default=32, help="int4 group size (32: llama.cpp's q4_0 block)")
    ap.add_argument("--int8_activations", action=argparse.BooleanOptionalAction, default=True,
                    help="build the int8/int4 engines with engine-build's --int8_activations (its default; "
                         "--no-int8_activations: W8A16/W4A16)")
    ap.add_argument("--quantize_lm_head", choices=["auto", "none", "int8", "int4"], default="auto",
                    help="engine-build --quantize_lm_head (auto: int8 for the int8/int4 engines)")
    ap.add_argument("--timing_cache", help="engine-build --timing_cache FILE")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the engines even if they exist")
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
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every Kiln engine and peer again this many times in turn, each cell keeping "
                         "its best: the memory bandwidth a shared machine leaves drifts by tens of percent "
                         "within minutes, so runtimes timed minutes apart once each are not compared fairly")
    ap.add_argument("--skip_hf", action="store_true")
    ap.add_argument("--llama_cpp", action="store_true",
                    help="also measure llama.cpp (llama-cpp-python built from source) at bf16, q8_0, q4_0")
    ap.add_argument("--openvino", action="store_true",
                    help="also measure OpenVINO GenAI at fp16, int8, int4 (benchmarks/openvino_bench.py)")
    ap.add_argument("--ort_genai", action="store_true",
                    help="also measure ONNX Runtime GenAI at int4, int8 (benchmarks/ort_genai_bench.py)")
    ap.add_argument("--peer_python", default=sys.executable,
                    help="the Python whose venv has the peers' exporters (optimum-intel, onnxruntime-genai's builder)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    import transformers

    from kiln import LLM
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig
    from kiln.convert.cli import convert_checkpoint
    from kiln.convert.quantize.pipeline import QuantOptions

    sys.path.insert(0, str(Path(__file__).parent))  # roofline, all_reduce and the peers' modules
    print(cpu_summary())
    print(f"load average at the start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    parallel = list(dict.fromkeys(args.parallel + ([(args.tp, 1)] if args.tp else []) + ([(1, args.pp)] if args.pp else [])))
    parallel = [m for m in parallel if m != (1, 1)]
    args.formats = list(dict.fromkeys(args.formats))
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = args.hf_dir or make_model(work / ("hf" if args.shape == "smollm-135m" else f"hf_{args.shape}"), dtype,
                                       SHAPES[args.shape])
    shape = f"_{args.shape}" if args.shape != "smollm-135m" and not args.hf_dir else ""
    options = {None: "", True: "_autotune", False: "_noautotune"}[args.max_autotune]
    options += (f"_{args.attention}" if args.attention else "") + (f"_gemm{args.gemm}" if args.gemm else "")
    options += "" if args.quantize_lm_head == "auto" else f"_head{args.quantize_lm_head}"
    max_batch = max(args.batch)
    quantized = lambda fmt: fmt not in ("bf16", args.dtype)  # noqa: E731
    name = lambda fmt: fmt if quantized(fmt) else args.dtype  # noqa: E731
    builds = {}

    def engine_for(fmt: str, tp: int, pp: int) -> Path:
        """The engine of this format and mapping, converted and built unless it is there already."""
        weights = args.dtype + shape + (f"_{fmt}_g{args.group_size}" if quantized(fmt) else "")
        label = "" if (tp, pp) == (1, 1) else f"_tp{tp}pp{pp}"
        int8_act = args.int8_activations and quantized(fmt)
        engine_dir = work / f"engine_{args.backend}_{weights}{options}{'_int8act' if int8_act else ''}{label}"
        if not args.rebuild and (engine_dir / "config.json").exists():
            return engine_dir
        ckpt = work / f"ckpt_{weights}{label}"
        if not (ckpt / "config.json").exists():
            quant = QuantOptions(qformat=fmt, group_size=args.group_size) if quantized(fmt) else None  # RTN
            convert_checkpoint(hf_dir, ckpt, dtype=args.dtype, tp_size=tp, pp_size=pp, quant=quant)
        longest = max(args.input_len, args.prefill_len, args.long_context)
        build = BuildConfig(max_batch_size=max(max_batch, 2), max_input_len=longest,
                            max_seq_len=max(args.input_len + args.output_len, longest + 64),
                            max_num_tokens=max(max_batch * args.input_len, longest),
                            tokens_per_block=32, backend=args.backend, max_autotune=args.max_autotune,
                            timing_cache=args.timing_cache, int8_activations=int8_act,
                            quantize_lm_head=args.quantize_lm_head)
        if args.attention:
            build.plugin_config["gpt_attention_plugin"] = args.attention
        if args.gemm:
            build.plugin_config["gemm_plugin"] = args.gemm
        ranks = []
        start = time.perf_counter()
        build_engine(ckpt, engine_dir, build, workers=args.build_workers or tp * pp,
                     log=lambda m: (print(m, file=sys.stderr), ranks.append(m) if m.startswith("rank ") else None))
        builds[(fmt, (tp, pp))] = {"seconds": time.perf_counter() - start, "ranks": ranks,
                                   "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        return engine_dir

    engines = {(fmt, m): engine_for(fmt, *m) for fmt in args.formats for m in [(1, 1), *parallel]}
    if args.build_only:
        for (fmt, (tp, pp)), path in engines.items():
            b = builds.get((fmt, (tp, pp)))
            print(f"engine {name(fmt)} tp {tp} x pp {pp}: {path}, " + (f"built in {b['seconds']:.1f}s" + "".join(
                f"\n  {r}" for r in b["ranks"]) if b else "already built"))
        return

    first = (args.formats[0], (1, 1))
    engine_dir = engines[first]
    written = bytes_written()
    start = time.perf_counter()
    llm = LLM(engine_dir)
    load = {"seconds": time.perf_counter() - start, "mb_written": (bytes_written() - written) / 2**20
            if written is not None else None}
    vocab = llm.llm_engine.model_config.vocab_size
    build_seconds = builds.get(first, {}).get("seconds")
    results = {"cpu": cpu_summary(), "engine": str(engine_dir), "build_seconds": build_seconds, "load": load,
               "threads": torch.get_num_threads(), "decode": {}, "prefill": {}, "kiln": {}}

    def measure(engine, key) -> dict:
        """One engine's decode tokens/s at each --batch and prefill tokens/s, into results["kiln"][fmt][TPxPP].
        With multi-rank engines in the run every engine's decode is timed the same way, from the first
        token to the last finish (time_kiln subtracts a separately timed prefill, as time_hf does)."""
        decode = decode_kiln if parallel else time_kiln
        fmt, (tp, pp) = key
        entry = results["kiln"].setdefault(fmt, {}).setdefault(f"{tp}x{pp}", {
            "engine": str(engines[key]), "build": builds.get(key)})
        keep_best(entry, {
            "decode": {b: max(decode(engine, b, args.input_len, args.output_len, vocab) for _ in range(args.repeats))
                       for b in args.batch},
            "prefill": max(prefill_kiln(engine, args.prefill_len, vocab) for _ in range(args.repeats))})
        return entry

    ours = measure(llm, first)
    if not parallel:  # against HF, measured the same way
        hf = None if args.skip_hf else transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
        for batch in args.batch:
            theirs = max(time_hf(hf, batch, args.input_len, args.output_len, vocab)
                         for _ in range(args.repeats)) if hf else None
            results["decode"][batch] = {"kiln": ours["decode"][batch], "hf": theirs}
        results["prefill"][args.prefill_len] = {"kiln": ours["prefill"],
                                                "hf": prefill_hf(hf, args.prefill_len, vocab) if hf else None}
        del hf
    if args.long_context:
        short = decode_seconds_at(llm, args.input_len, vocab)
        long = decode_seconds_at(llm, args.long_context, vocab)
        results["long_context"] = {"context": args.long_context, "short_s": short, "long_s": long}
    if args.prefill_len + 15 <= llm.llm_engine.core.scheduler.max_num_tokens and max_batch >= 16 and not parallel:
        mixed, pre, dec = mixed_step(llm.llm_engine, vocab, args.prefill_len, 15, args.input_len)
        results["mixed_step"] = {"mixed_s": mixed, "prefill_s": pre, "decode15_s": dec}
    if args.roofline:
        from roofline import bandwidth, decode_bytes_per_token

        threads = results["threads"]
        roof = max(v for t in sorted({1, threads}) for v in bandwidth(1.0, t).values())
        torch.set_num_threads(threads)
        moved = decode_bytes_per_token(llm.llm_engine.core.executor.engine, args.input_len + args.output_len // 2)
        total, active = llm.llm_engine.model_config.parameter_counts()
        results["roofline"] = {"gb_s": roof, "batch1_gb_s": moved * ours["decode"][min(args.batch)] / 1e9,
                               "bytes_per_token": moved, "parameters": total, "active_parameters": active}
    llm.llm_engine.shutdown()
    del llm
    for key, other_dir in engines.items():
        if key != first:
            start = time.perf_counter()
            other = LLM(other_dir)
            measure(other, key)["load_seconds"] = time.perf_counter() - start
            other.llm_engine.shutdown()
            del other
    for rnd in range(args.rounds):
        if rnd:  # the first round measured the first engine above, with HF and the roofline
            from roofline import bandwidth

            read = bandwidth(0.25, results["threads"])["read"]
            results.setdefault("round_read_gb_s", []).append(read)
            print(f"round {rnd + 1} of {args.rounds}: read bandwidth now {read:.1f} GB/s", file=sys.stderr)
            for key, path in engines.items():
                other = LLM(path)
                measure(other, key)
                other.llm_engine.shutdown()
                del other
        for flag in PEERS:
            if getattr(args, flag):
                for kind, r in peer_results(flag, hf_dir, work, args, vocab).items():
                    keep_best(results.setdefault(flag, {}).setdefault(kind, {}), r)
    for batch, r in results["decode"].items():  # the first engine's best round, against HF's
        r["kiln"] = results["kiln"][first[0]]["1x1"]["decode"][batch]
    for r in results["prefill"].values():
        r["kiln"] = results["kiln"][first[0]]["1x1"]["prefill"]
    if any(tp > 1 for tp, _ in parallel):
        import all_reduce

        p = json.loads((engine_dir / "config.json").read_text())["pretrained_config"]
        results["all_reduce"] = all_reduce.run(p["hidden_size"], sorted({*args.batch, args.prefill_len}), args.dtype)
    results["load_average_end"] = os.getloadavg()[0]
    results["prefix_cache"] = dict(cache_share)
    share = cache_share["cached_tokens"] / max(cache_share["prompt_tokens"], 1)
    print(f"prefix cache: {cache_share['cached_tokens']} of the {cache_share['prompt_tokens']} prompt tokens of "
          f"the timed Kiln calls were served from it ({share:.1%}; every timed prompt is fresh)")

    def row(label, r):
        ratio = f"{r['kiln'] / r['hf']:.2f}x" if r["hf"] else "-"
        hf_s = f"{r['hf']:.1f}" if r["hf"] else "-"
        print(f"{label:<32} {r['kiln']:>10.1f} {hf_s:>10} {ratio:>8}")

    if results["decode"]:
        print(f"{'tokens/s (' + name(first[0]) + ', ' + str(results['threads']) + ' threads)':<32} "
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
              f"= {r['batch1_gb_s'] / r['gb_s']:.0%} ({r['bytes_per_token'] / 1e6:.1f} MB per token: "
              f"{r['active_parameters'] / 1e6:.1f}M active parameters of {r['parameters'] / 1e6:.1f}M, and the K/V)")
    if len(args.formats) > 1 or any(flag in results for flag in PEERS):
        print(f"\ntokens/s, {results['threads']} threads | " + " | ".join(f"decode b{b}" for b in args.batch)
              + f" | prefill {args.prefill_len}")
        rows = [(f"Kiln {name(fmt)}" + (" (int8 activations)" if args.int8_activations and quantized(fmt) else ""),
                 results["kiln"][fmt]["1x1"]) for fmt in args.formats]
        rows += [(f"{label} {kind}", r) for flag, (label, *_) in PEERS.items()
                 for kind, r in results.get(flag, {}).items()]
        if results["prefill"].get(args.prefill_len, {}).get("hf"):
            rows.append((f"HF {args.dtype}", {"decode": {b: r["hf"] for b, r in results["decode"].items()},
                                              "prefill": results["prefill"][args.prefill_len]["hf"]}))
        for label, r in rows:
            print(f"{label} | " + " | ".join(f"{r['decode'][b]:.1f}" for b in args.batch) + f" | {r['prefill']:.1f}")
    for fmt in args.formats if parallel else []:
        one, labels = results["kiln"][fmt]["1x1"], [f"{tp}x{pp}" for tp, pp in parallel]
        print(f"\n{'tokens/s against one rank (' + name(fmt) + ')':<32} {'tp1':>10} "
              + " ".join(f"{'tp' + m.replace('x', ' pp'):>16}" for m in labels))
        measures = [(f"decode batch {b} ({args.input_len}+{args.output_len})", lambda e, b=b: e["decode"][b])
                    for b in args.batch]
        measures.append((f"prefill {args.prefill_len} tokens", lambda e: e["prefill"]))
        for label, value in measures:
            base = value(one)
            cells = [f"{value(results['kiln'][fmt][m]):>9.1f} {value(results['kiln'][fmt][m]) / base:>5.2f}x"
                     for m in labels]
            print(f"{label:<32} {base:>10.1f} " + " ".join(f"{c:>16}" for c in cells))
    for fmt, (tp, pp) in list(engines)[1:]:
        e = results["kiln"][fmt][f"{tp}x{pp}"]
        b = e["build"]
        ranks = f" ({'; '.join(b['ranks'])})" if b and b["ranks"] else ""
        print(f"{name(fmt)} tp {tp} x pp {pp}: load {e['load_seconds']:.1f}s"
              + (f", build {b['seconds']:.1f}s{ranks}" if b else ""))
    if "all_reduce" in results:
        r = results["all_reduce"]
        print("one all-reduce of [tokens, hidden] between 2 ranks: " + ", ".join(
            f"{t} tokens shm {r['shm'][t] * 1e6:.0f} us / gloo {r['gloo'][t] * 1e6:.0f} us" for t in sorted(r["shm"])))
    print(f"load average at the end: {results['load_average_end']:.1f}")
    ranks_mb = sum(f.stat().st_size for f in engine_dir.glob("rank*.engine")) / 2**20
    written = f", {load['mb_written']:.0f} MB written" if load["mb_written"] is not None else ""
    print(f"engine load ({name(first[0])}, until the first request can run): {load['seconds']:.1f}s{written}, "
          f"for {ranks_mb:.0f} MB of rank engines")
    if build_seconds is not None:
        autotune = json.loads((engine_dir / "config.json").read_text())["build_config"]["max_autotune"]
        size = sum(f.stat().st_size for f in engine_dir.iterdir()) / 2**20
        print(f"engine build: {build_seconds:.1f}s, peak RSS {builds[first]['peak_rss_mb']:.0f} MB, {size:.0f} MB "
              f"({args.backend}{', max-autotune' if autotune else ''})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
