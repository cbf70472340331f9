"""Where an engine step's time goes: the compiled engine call against the host work around it.

Decodes --batch sequences through `LLMEngine.step` and splits each step's wall time into scheduling,
building the input tensors, the engine call, sampling and the rest (appending tokens, detokenizing,
stop checks, building outputs), by timing the methods `step` calls. Reported per step, as mean
milliseconds and as a share of the step.

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
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top_p", type=float, default=1.0)
    args = ap.parse_args()

    from kiln.runtime.llm_engine import LLMEngine

    engine = LLMEngine(args.engine_dir, threads=args.threads)
    print(f"{'batch':>5} {'step ms':>8} " + " ".join(f"{p:>14}" for p in PHASES) + f" {'host':>14}")
    for batch in args.batch:
        sampling = dict(temperature=args.temperature, top_p=args.top_p)
        profile(engine, batch, args.input_len, 4, **sampling)  # warm-up
        r = profile(engine, batch, args.input_len, args.steps, **sampling)
        host = r["step"] - r["engine"]
        cells = " ".join(f"{r[p]:>6.2f} ({r[p] / r['step']:>4.0%})" for p in PHASES)
        print(f"{batch:>5} {r['step']:>8.2f} {cells} {host:>6.2f} ({host / r['step']:>4.0%})")
    print(f"threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
