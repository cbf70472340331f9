"""A decode step's time must not depend on the KV pool's size: the engine writes the pool in place.

Runs the same batch-1 decode steps against pools of very different sizes and prints the step time of
each, with the ratio to the smallest pool.

  python benchmarks/kv_pool.py --engine_dir bench_out/throughput/engine_aoti_bfloat16
"""
import argparse
import time

from kiln.engine.loader import RankEngine
from kiln.runtime.core.step_plan import plan_step, tables_of
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.core.request import Request, Sequence


def decode_step_ms(engine: RankEngine, context: int, steps: int) -> float:
    bs = engine.config.build_config.tokens_per_block
    req = Request("r", list(range(3, 3 + context)), SamplingParams(), 1)
    seq = Sequence(req, 0, list(req.prompt_token_ids))
    # The sequence's blocks sit at the far end of the pool, so a copy of the pool would show.
    seq.block_table = list(range(engine.num_blocks - 1, engine.num_blocks - 1 - (-(-context // bs)), -1))
    seq.num_computed_tokens = context - 1
    plan = plan_step(SchedulerOutput([(seq, 1)]), bs, tables_of([seq]))
    engine(plan.inputs)
    start = time.perf_counter()
    for _ in range(steps):
        engine(plan.inputs)
    return (time.perf_counter() - start) / steps * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine_dir", required=True)
    ap.add_argument("--pool_tokens", type=int, nargs="+", default=[1024, 16384, 131072])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    base = None
    print(f"{'pool tokens':>12} {'pool MB':>10} {'step ms':>10} {'ratio':>8}")
    for tokens in args.pool_tokens:
        engine = RankEngine(args.engine_dir, max_tokens_in_paged_kv_cache=tokens)
        ms = decode_step_ms(engine, args.context, args.steps)
        base = base or ms
        mb = engine.kv_cache.numel() * engine.kv_cache.element_size() / 2**20
        print(f"{tokens:>12} {mb:>10.0f} {ms:>10.2f} {ms / base:>7.2f}x")
        del engine


if __name__ == "__main__":
    main()
