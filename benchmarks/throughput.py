"""Offline generation throughput: Kiln against HF transformers `generate` on the same weights, same run.

By default it makes a random-weight model of SmolLM-135M's shape (hidden 576, 30 layers, 9 heads,
3 KV heads, intermediate 1536, vocab 49152, tied embeddings), converts and builds it, then measures
  - decode tokens/s at each --batch size (prompts of --input_len tokens, --output_len new tokens),
  - prefill tokens/s of one --prefill_len prompt,
for Kiln and for HF, and prints the ratios. Prompts are random token ids of equal length, so HF's
batched generate needs no padding.

  python benchmarks/throughput.py --batch 1 16 --output_len 128 --json out.json
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

SMOLLM_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                   tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
                   bos_token_id=0, eos_token_id=0)


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
    ap.add_argument("--rebuild", action="store_true", help="rebuild the engine even if one exists")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input_len", type=int, default=128)
    ap.add_argument("--output_len", type=int, default=128)
    ap.add_argument("--prefill_len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--skip_hf", action="store_true")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()

    import transformers

    from kiln import LLM
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig
    from kiln.convert.cli import convert_checkpoint

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = args.hf_dir or make_model(work / "hf", dtype)
    suffix = {None: "", True: "_autotune", False: "_noautotune"}[args.max_autotune]
    if args.attention:
        suffix += f"_{args.attention}"
    engine_dir = work / f"engine_{args.backend}_{args.dtype}{suffix}"
    max_batch = max(args.batch)
    build_seconds = None
    if args.rebuild or not (engine_dir / "config.json").exists():
        ckpt = convert_checkpoint(hf_dir, work / f"ckpt_{args.dtype}", dtype=args.dtype)
        build = BuildConfig(max_batch_size=max(max_batch, 2), max_input_len=max(args.input_len, args.prefill_len),
                            max_seq_len=max(args.input_len + args.output_len, args.prefill_len + 1),
                            max_num_tokens=max(max_batch * args.input_len, args.prefill_len),
                            tokens_per_block=32, backend=args.backend, max_autotune=args.max_autotune)
        if args.attention:
            build.plugin_config["gpt_attention_plugin"] = {"inline": None, "cpp": "cpp"}[args.attention]
        start = time.perf_counter()
        build_engine(ckpt, engine_dir, build, log=lambda m: print(m, file=sys.stderr))
        build_seconds = time.perf_counter() - start

    llm = LLM(engine_dir)
    vocab = llm.llm_engine.model_config.vocab_size
    results = {"engine": str(engine_dir), "build_seconds": build_seconds, "threads": torch.get_num_threads(),
               "decode": {}, "prefill": {}}
    hf = None
    if not args.skip_hf:
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    for batch in args.batch:
        ours = time_kiln(llm, batch, args.input_len, args.output_len, vocab)
        theirs = time_hf(hf, batch, args.input_len, args.output_len, vocab) if hf else None
        results["decode"][batch] = {"kiln": ours, "hf": theirs}
    ours = prefill_kiln(llm, args.prefill_len, vocab)
    theirs = prefill_hf(hf, args.prefill_len, vocab) if hf else None
    results["prefill"][args.prefill_len] = {"kiln": ours, "hf": theirs}

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
    if build_seconds is not None:
        autotune = llm.llm_engine.build_config.max_autotune
        print(f"engine build: {build_seconds:.1f}s ({args.backend}{', max-autotune' if autotune else ''})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
