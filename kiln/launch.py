"""Runs a multi-rank engine on ranks torchrun starts, across processes and machines.

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank {0,1} --master-addr HOST --master-port PORT \\
        -m kiln.launch serve --engine_dir ENGINE_DIR [kiln serve options]

Rank 0 runs the kiln command given (`serve`, `run`, `eval-ppl`: the frontend and the engine core,
which runs rank 0's engine); every other rank loads its rank engine and runs the steps rank 0
broadcasts (kiln/runtime/executor/torchrun.py). Launch exactly as many ranks as the engine has
(tp_size x pp_size). Ranks on one node all-reduce through shared memory, across nodes through gloo.
"""
import os
import sys

USAGE = "usage: torchrun [torchrun options] -m kiln.launch {serve,run,eval-ppl} --engine_dir DIR [options]"


def engine_dir_of(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        for name in ("--engine_dir", "--engine-dir"):
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    engine_dir = engine_dir_of(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or engine_dir is None:
        print(f"kiln.launch: {'--engine_dir is required' if engine_dir is None else 'run it under torchrun'}"
              f"\n{USAGE}", file=sys.stderr)
        return 2
    if int(os.environ["RANK"]) != 0:
        from kiln.runtime.executor.torchrun import serve_rank

        return serve_rank(engine_dir)
    from kiln.cli import cli
    from kiln.runtime.executor.factory import EXECUTOR_ENV

    os.environ[EXECUTOR_ENV] = "torchrun"  # for the engine core, in this process or the one it starts
    return cli.main(args=argv, prog_name="kiln", standalone_mode=True)


if __name__ == "__main__":
    sys.exit(main())
