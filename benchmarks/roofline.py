"""Memory-bandwidth roofline of this machine, and how close batch-1 decode of an engine gets to it.

Batch-1 decode reads every weight and the sequence's K/V once per token, so its speed is bounded by
memory bandwidth. This measures the bandwidth (large-array copy and read, one stream and one stream
per thread; read+write bytes both counted; the best figure is the roofline), then decodes with the
engine and prints the bytes it moved per second as a fraction of that.

  python benchmarks/roofline.py --engine_dir bench_out/throughput/engine_aoti_bfloat16
"""
import argparse
import time

import torch


def bandwidth(gib: float, threads: int, repeats: int = 5) -> dict[str, float]:
    """Best GB/s of copy (read + write) and of read (a sum), with `threads` intra-op threads."""
    torch.set_num_threads(threads)
    n = int(gib * 2**30) // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)  # fault the pages in
    best = {"copy": 0.0, "read": 0.0}
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best["copy"] = max(best["copy"], 2 * n * 4 / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        src.sum()
        best["read"] = max(best["read"], n * 4 / (time.perf_counter() - start) / 1e9)
    return best


def decode_bytes_per_token(engine, context: int) -> int:
    """The weights a token is computed with (each read once per step; a mixture of experts' chosen
    experts only), at the width the engine stores them, plus the K/V of `context` tokens. Quantized
    linears count their packed bytes (int4: half a byte and a float16 scale per group); the router,
    norms and biases, a few percent of the parameters, are counted at the linears' width too."""
    from kiln.build.settings import lm_head_quantization
    from kiln.models.linear import INT4_ALGOS

    p, build = engine.config.pretrained_config, engine.config.build_config
    itemsize = torch.empty(0, dtype=getattr(torch, p.dtype)).element_size()
    q = p.quantization

    def width(algo) -> float:  # bytes per parameter
        return itemsize if algo is None else 0.5 + 2 / q.group_size if algo in INT4_ALGOS else 1.0

    head = p.vocab_size * p.hidden_size  # the vocab GEMM reads the whole (tied or separate) lm_head
    linears = p.parameter_counts()[1] - head * (1 if p.tie_word_embeddings else 2)  # the embedding lookup: one row
    lm_head = {"int8": width("W8A16"), "int4": width("W4A16")}.get(
        lm_head_quantization(build.quantize_lm_head, p, build.plugin_config["gemm_plugin"]), itemsize)
    kv_per_token = engine.bytes_per_block // build.tokens_per_block
    return int(linears * width(q.quant_algo) + head * lm_head + context * kv_per_token)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine_dir", help="engine to measure (omit for the bandwidth figures alone)")
    ap.add_argument("--gib", type=float, default=1.0, help="array size for the bandwidth test")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--input_len", type=int, default=128)
    ap.add_argument("--output_len", type=int, default=128)
    args = ap.parse_args()

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from throughput import cpu_banner

    print(cpu_banner())
    results = {t: bandwidth(args.gib, t) for t in sorted({1, args.threads})}
    for t, r in results.items():
        print(f"{t} thread(s): copy {r['copy']:.1f} GB/s (read+write), read {r['read']:.1f} GB/s")
    roofline = max(v for r in results.values() for v in r.values())
    print(f"roofline: {roofline:.1f} GB/s")
    if not args.engine_dir:
        return

    from kiln import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.engine_dir)
    vocab = llm.llm_engine.model_config.vocab_size
    prompt = {"prompt_token_ids": [(7 * i) % (vocab - 3) + 3 for i in range(args.input_len)]}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    out = llm.generate([prompt], params)[0]
    per_token = out.metrics.time_per_output_token
    mean_context = args.input_len + args.output_len // 2
    moved = decode_bytes_per_token(llm.llm_engine.core.executor.engine, mean_context)
    achieved = moved / per_token / 1e9
    print(f"batch-1 decode: {1 / per_token:.1f} tokens/s, {moved / 2**20:.1f} MiB read per token, "
          f"{achieved:.1f} GB/s = {achieved / roofline:.0%} of the roofline")


if __name__ == "__main__":
    main()
