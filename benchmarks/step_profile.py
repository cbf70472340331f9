"""Where an engine step's time goes: the compiled engine call against the host work around it.

Decodes --batch sequences through `LLMEngine.step` and splits each step's wall time into scheduling,
building the input tensors, the engine call, sampling and the rest (appending tokens, detokenizing,
stop checks, building outputs), by timing the methods `step` calls. Reported per step, as mean
milliseconds and as a share of the step, greedy and then with --sampled parameters (by default the
issue's `temperature 0.8, top_p 0.95, top_k 50, repetition_penalty 1.1`; "" for greedy only), with
the sampled run's throughput as a share of the greedy one's, measured in the same run.

  python benchmarks/step_profile.py --engine_dir bench_out/throughput/engine_aoti_bfloat16 --batch 1 16
"""
import argparse
import time
from collections import defaultdict

import torch

PHASES = ("schedule", "plan", "engine", "sample", "rest")


def profile(engine, batch: int, input_len: int, steps: int, **sampling) -> dict[str, float]:
    from kiln import SamplingParams
    from kiln.runtime import llm_engine as mod

    vocab = engine.model_config.vocab_size
    params = SamplingParams(**{"temperature": 0, **sampling}, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request({"prompt_token_ids": [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(input_len)]},
                           params)
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.waiting) \
            or engine.scheduler.waiting:
        engine.step()  # prefill (possibly chunked), not measured

    spent = defaultdict(float)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return wrapper

    # Instance attributes shadow the methods for this engine only; plan_step is looked up in the module.
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.engine.model = timed("engine", engine.engine.model)
    engine.sampler = timed("sample", engine.sampler)
    plan_step = mod.plan_step
    mod.plan_step = timed("plan", plan_step)
    try:
        total = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            total += time.perf_counter() - start
    finally:
        mod.plan_step = plan_step
    for rid in list(engine.requests):
        engine.abort(rid)
    result = {name: spent[name] / steps * 1e3 for name in PHASES[:-1]}
    result["rest"] = total / steps * 1e3 - sum(result.values())
    result["step"] = total / steps * 1e3
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine_dir", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input_len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sampled", default="temperature=0.8,top_p=0.95,top_k=50,repetition_penalty=1.1",
                    help="sampling parameters of the second run, k=v,...; empty: greedy only")
    ap.add_argument("--repeats", type=int, default=1,
                    help="profile greedy and sampled this many times, alternating, and keep each one's fastest "
                         "(a shared machine's stalls)")
    ap.add_argument("--sampler", default=None, choices=["auto", "cpp", "torch"], help="the Sampler backend")
    args = ap.parse_args()

    from kiln.runtime.llm_engine import LLMEngine
    from kiln.runtime.sampler import Sampler

    engine = LLMEngine(args.engine_dir, threads=args.threads)
    engine.sampler = Sampler(args.sampler)
    runs = {"greedy": {}}
    for item in filter(None, args.sampled.split(",")):
        key, value = item.split("=")
        runs.setdefault("sampled", {})[key.strip()] = int(value) if key.strip() == "top_k" else float(value)
    print(f"sampler: {engine.sampler.backend}; sampled: {args.sampled or '-'}")
    print(f"{'batch':>5} {'run':>8} {'step ms':>8} " + " ".join(f"{p:>14}" for p in PHASES) + f" {'host':>14}")
    for batch in args.batch:
        best = {}
        for _ in range(args.repeats):  # alternating runs, the fastest of each kept
            for name, sampling in runs.items():
                profile(engine, batch, args.input_len, 4, **sampling)  # warm-up
                r = profile(engine, batch, args.input_len, args.steps, **sampling)
                if name not in best or r["step"] < best[name]["step"]:
                    best[name] = r
        for name, r in best.items():
            host = r["step"] - r["engine"]
            cells = " ".join(f"{r[p]:>6.2f} ({r[p] / r['step']:>4.0%})" for p in PHASES)
            print(f"{batch:>5} {name:>8} {r['step']:>8.2f} {cells} {host:>6.2f} ({host / r['step']:>4.0%})")
        if "sampled" in best:
            print(f"{batch:>5} sampled throughput / greedy: {best['greedy']['step'] / best['sampled']['step']:.2f}x")
    print(f"threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
