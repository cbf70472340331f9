"""Paged attention per layer: the C++ plugin (torch.ops.kiln_cpp.paged_attention) against the inline
torch path (kiln.plugins.cpu.paged_attention, which gathers the pages and runs SDPA), both eager.

Shapes default to one layer of SmolLM-135M (9 heads, 3 KV heads, head_dim 64) with a bf16 cache in
blocks of 32. Measures decode steps (one token per sequence) at each --batch and --context, and one
--prefill_len-token prefill, and prints the median times and the ratio.

  python benchmarks/paged_attention.py --batch 1 16 --context 128 4096 --prefill_len 512
"""
import argparse
import random
import statistics
import time

import torch

from kiln.plugins import cpp, cpu


def make_step(num_ctx, ctx_len, num_gen, gen_len, *, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """One layer's pool and a step of num_ctx full prefills of ctx_len tokens and num_gen decodes at
    context gen_len, each sequence on shuffled pages."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = lambda n: -(-n // block_size)  # noqa: E731
    num_blocks = num_ctx * need(ctx_len) + num_gen * need(gen_len) + 1
    pages = list(range(num_blocks))
    rng.shuffle(pages)
    cache = torch.randn(1, 2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    T = num_ctx * ctx_len + num_gen
    q = torch.randn(T, heads, head_dim, generator=g).to(dtype)

    def tables(n, length):
        return torch.tensor([[pages.pop() for _ in range(need(length))] for _ in range(n)],
                            dtype=torch.int32).view(n, need(length) if n else 1)

    return (q, cache, 0,
            torch.arange(num_ctx * ctx_len).view(num_ctx, ctx_len if num_ctx else 1),
            tables(num_ctx, ctx_len), torch.full((num_ctx,), ctx_len, dtype=torch.int32),
            torch.arange(num_ctx * ctx_len, T), tables(num_gen, gen_len),
            torch.full((num_gen,), gen_len, dtype=torch.int32), head_dim ** -0.5)


def times_ms(fn, args, min_time=1.0, min_runs=5):
    """(median, min) wall time in ms; on a shared machine the min is the closer to the op's own cost."""
    for _ in range(2):
        fn(*args)
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--prefill_len", type=int, default=512)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv_heads", type=int, default=3)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--block_size", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    op = cpp.paged_attention_op()
    shape = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                 dtype=getattr(torch, args.dtype))
    cases = [(f"decode batch {b:>2} context {c:>5}", (0, 1, b, c)) for c in args.context for b in args.batch]
    if args.prefill_len:
        cases.append((f"prefill {args.prefill_len} tokens", (1, args.prefill_len, 0, 1)))
    print(f"paged attention, one layer: {args.heads} heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
          f"{args.dtype}, blocks of {args.block_size}, {torch.get_num_threads()} threads, "
          f"C++ kernel {cpp.kernel_capability()}")
    print(f"{'':34} {'inline torch ms (min)':>22} {'C++ plugin ms (min)':>20} {'speedup':>8}")
    with torch.inference_mode():
        for label, (nc, cl, ng, gl) in cases:
            step = make_step(nc, cl, ng, gl, **shape)
            torch.testing.assert_close(op(*step).float(), cpu.paged_attention(*step).float(), atol=2e-2, rtol=2e-2)
            ref, ref_min = times_ms(cpu.paged_attention, step)
            ours, ours_min = times_ms(op, step)
            print(f"{label:34} {ref:12.3f} ({ref_min:7.3f}) {ours:10.3f} ({ours_min:7.3f}) {ref / ours:7.1f}x",
                  flush=True)


if __name__ == "__main__":
    main()
