"""Where an engine step's time goes: the compiled engine call against the host work around it.

Decodes --batch sequences through `LLMEngine.step` (the engine core in this thread, so that every
phase can be timed) and splits each step's wall time into scheduling, building the input tensors,
the engine call, sampling, the rest of the core (appending tokens, stop checks, outputs) and the
frontend (detokenizing, stop strings, RequestOutputs), by timing the methods a step calls. Each
batch runs greedy and sampled (temperature 0.8, top_p 0.95, top_k 50, repetition_penalty 1.1).
Reported per step, as mean milliseconds and as a share of the step.

  python benchmarks/step_profile.py --engine_dir bench_out/throughput/engine_aoti_bfloat16 --batch 1 16 64
"""
import argparse
import time
from collections import defaultdict

import torch

PHASES = ("schedule", "plan", "engine", "sample", "frontend", "rest")
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1)


def profile(engine, batch: int, input_len: int, steps: int, **sampling) -> dict[str, float]:
    from kiln import SamplingParams
    from kiln.runtime.core import engine_core as mod

    core = engine.core
    vocab = engine.model_config.vocab_size
    params = SamplingParams(**{"temperature": 0, **sampling}, max_tokens=steps + 1, ignore_eos=True, seed=0)
    for i in range(batch):
        engine.add_request({"prompt_token_ids": [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(input_len)]},
                           params)
    while any(s.prefilling for s in core.scheduler.running) or core.scheduler.waiting:
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

    # Instance attributes shadow the methods for this engine only (and are put back after);
    # plan_step is looked up in the module.
    patched = [(core.scheduler, "schedule"), (core.executor, "execute"), (core, "sampler"),
               (engine.output_processor, "process")]
    names = dict(schedule="schedule", execute="engine", sampler="sample", process="frontend")
    saved = [getattr(obj, attr) for obj, attr in patched]
    for obj, attr in patched:
        setattr(obj, attr, timed(names[attr], getattr(obj, attr)))
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
        for (obj, attr), original in zip(patched, saved):
            setattr(obj, attr, original)
    for rid in list(engine.output_processor.requests):
        engine.abort(rid)
    result = {name: spent[name] / steps * 1e3 for name in PHASES[:-1]}
    result["rest"] = total / steps * 1e3 - sum(result.values())
    result["step"] = total / steps * 1e3
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine_dir", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--input_len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="profile greedy and sampled this many times, alternating, and keep each one's fastest "
                         "(a shared machine's stalls)")
    ap.add_argument("--sampler", default=None, choices=["auto", "cpp", "torch"], help="the Sampler backend")
    args = ap.parse_args()

    from kiln.runtime.frontend.llm_engine import LLMEngine
    from kiln.runtime.core.sample.sampler import Sampler
    from kiln.utils import cpu_summary

    print(cpu_summary())
    engine = LLMEngine(args.engine_dir, threads=args.threads)
    engine.core.sampler = Sampler(args.sampler)
    limit = engine.core.scheduler.max_batch_size
    print(f"sampler: {engine.core.sampler.backend}; sampled: {SAMPLED}")
    print(f"{'batch':>5} {'sampling':>8} {'step ms':>8} " + " ".join(f"{p:>14}" for p in PHASES) + f" {'host':>14}")
    for batch in args.batch:
        if batch > limit:
            print(f"{batch:>5} skipped: over the engine's max_batch_size ({limit})")
            continue
        best = {}
        for _ in range(args.repeats):  # alternating runs, the fastest of each kept
            for label, sampling in (("greedy", {}), ("sampled", SAMPLED)):
                profile(engine, batch, args.input_len, 4, **sampling)  # warm-up
                r = profile(engine, batch, args.input_len, args.steps, **sampling)
                if label not in best or r["step"] < best[label]["step"]:
                    best[label] = r
        for label, r in best.items():
            host = r["step"] - r["engine"]
            cells = " ".join(f"{r[p]:>6.2f} ({r[p] / r['step']:>4.0%})" for p in PHASES)
            print(f"{batch:>5} {label:>8} {r['step']:>8.2f} {cells} {host:>6.2f} ({host / r['step']:>4.0%})")
        print(f"{batch:>5} sampled throughput / greedy: {best['greedy']['step'] / best['sampled']['step']:.2f}x")
    print(f"threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
