"""The token sampler alone: the torch reference against the kiln_cpp sampler, same logits, same run.

For each vocabulary size and batch: one `Sampler` call on [batch, vocab] float32 logits, greedy and
sampled (--sampled, by default the issue's `temperature 0.8, top_p 0.95, top_k 50,
repetition_penalty 1.1`), each row with a history of --prompt_len prompt and --output_len output
tokens (the repetition penalty reads both). Logits are N(0, 3^2) per token, about as peaked as a
small trained model's. Prints the best of --repeats milliseconds per call (on a shared machine the
median mostly measures threads waiting for a core) and the ratios, measured in the same run.

  python benchmarks/sampler.py --vocab 8192 49152 --batch 1 16 64 --threads 2
"""
import argparse
import os
import platform
import time

import torch


def cpu_line() -> str:
    model, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("?", "x86_64", ""):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model} ({' '.join(shown) or 'no AVX2'}); load average {os.getloadavg()[0]:.1f}"


def parse_params(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        out[key.strip()] = int(value) if key.strip() == "top_k" else float(value)
    return out


def time_call(sampler, logits, rows, repeats: int) -> float:
    sampler(logits, rows)  # warm-up (and the C++ library's first load)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, rows)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 49152])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--output_len", type=int, default=64)
    ap.add_argument("--sampled", default="temperature=0.8,top_p=0.95,top_k=50,repetition_penalty=1.1")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()

    from kiln import SamplingParams
    from kiln.runtime.core.sample.rows import SampleRow
    from kiln.runtime.core.sample.sampler import Sampler

    torch.set_num_threads(args.threads)
    samplers = {"torch": Sampler("torch"), "cpp": Sampler("cpp")}
    configs = {"greedy": SamplingParams(temperature=0), "sampled": SamplingParams(**parse_params(args.sampled))}
    print(f"cpu: {cpu_line()}; threads {torch.get_num_threads()}; sampled: {args.sampled}")
    print(f"{'vocab':>6} {'batch':>5} {'config':>8} {'torch ms':>9} {'cpp ms':>8} {'torch/cpp':>9}")
    for vocab in args.vocab:
        for batch in args.batch:
            g = torch.Generator().manual_seed(batch)
            logits = torch.randn(batch, vocab, generator=g) * 3
            hist = torch.randint(0, vocab, (batch, args.prompt_len + args.output_len), generator=g).tolist()
            cpp_ms = {}
            for name, params in configs.items():
                rows = [SampleRow(params, h[:args.prompt_len], h[args.prompt_len:], None, (0,)) for h in hist]
                ms = {backend: time_call(s, logits, rows, args.repeats) for backend, s in samplers.items()}
                cpp_ms[name] = ms["cpp"]
                print(f"{vocab:>6} {batch:>5} {name:>8} {ms['torch']:>9.3f} {ms['cpp']:>8.3f} "
                      f"{ms['torch'] / ms['cpp']:>8.1f}x")
            print(f"{'':>6} {batch:>5} cpp sampled - greedy: {cpp_ms['sampled'] - cpp_ms['greedy']:.3f} ms per step")


if __name__ == "__main__":
    main()
