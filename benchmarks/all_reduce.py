"""The cost of one tensor-parallel all-reduce between ranks on this machine: kiln_cpp::all_reduce
through its shared-memory communicator against the same op on gloo (what ranks on different
machines use), for a decode step's hidden state at several batch sizes and a prefill chunk's.

Two rank processes, one intra-op thread each (as a TP=2 engine on two cores runs them); each size
is timed `--repeats` times over `--iters` calls and the fastest run is kept (a shared machine's noise
only ever slows a run down).

  python benchmarks/all_reduce.py --hidden 576 --tokens 1 16 512
"""
import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch


def measure(tokens: int, hidden: int, dtype, iters: int, repeats: int) -> float:
    import torch.distributed as dist

    from kiln.models.parallel import TP_GROUP

    x = torch.randn(tokens, hidden).to(dtype)
    n = max(10, iters // max(1, tokens // 16))
    best = float("inf")
    for _ in range(repeats):
        for _ in range(20):
            torch.ops.kiln_cpp.all_reduce(x, TP_GROUP)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            torch.ops.kiln_cpp.all_reduce(x, TP_GROUP)
        best = min(best, (time.perf_counter() - start) / n)
    return best


def rank_main(rank: int, port: int, args) -> None:
    import torch.distributed as dist

    from kiln.models.parallel import TP_GROUP
    from kiln.plugins import cpp
    from kiln.runtime.executor.distributed import _register

    torch.set_num_threads(1)
    cpp.load()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    _register(TP_GROUP, dist.group.WORLD)
    dtype = getattr(torch, args.dtype)
    results = {"gloo": {}, "shm": {}}
    for t in args.tokens:
        results["gloo"][t] = measure(t, args.hidden, dtype, args.iters // 4, args.repeats)
    path = [f"/dev/shm/kiln-{os.getpid()}-bench-{port}" if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    slot = -(-max(args.tokens) * args.hidden * dtype.itemsize // 64) * 64
    torch.ops.kiln_cpp.shm_attach(TP_GROUP, path[0], rank, 2, min(slot, 4 << 20))
    dist.barrier()
    if rank == 0:
        os.unlink(path[0])
    for t in args.tokens:
        results["shm"][t] = measure(t, args.hidden, dtype, args.iters, args.repeats)
    if rank == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


def run(hidden: int, tokens: list[int], dtype: str = "float32", iters: int = 2000, repeats: int = 5) -> dict:
    """{"gloo"|"shm": {tokens: seconds per all-reduce}}, measured by two fresh rank processes."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    argv = ["--hidden", str(hidden), "--dtype", dtype, "--iters", str(iters), "--repeats", str(repeats),
            "--tokens", *map(str, tokens)]
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--rank", str(r), "--port", str(store.port)],
                              env=env, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True)
             for r in range(2)]
    out, _ = procs[0].communicate()
    if procs[1].wait() or procs[0].returncode:
        raise RuntimeError("an all-reduce rank failed")
    return {k: {int(t): s for t, s in v.items()} for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 512])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        return rank_main(args.rank, args.port, args)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kiln.utils import cpu_summary

    print(cpu_summary())
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    r = run(args.hidden, args.tokens, args.dtype, args.iters, args.repeats)
    print(f"{'all-reduce of [tokens, ' + str(args.hidden) + '] ' + args.dtype:<40} {'shm us':>9} {'gloo us':>9} {'gloo/shm':>9}")
    for t in args.tokens:
        print(f"{'tokens ' + str(t):<40} {r['shm'][t] * 1e6:>9.1f} {r['gloo'][t] * 1e6:>9.1f} "
              f"{r['gloo'][t] / r['shm'][t]:>8.1f}x")


if __name__ == "__main__":
    main()
