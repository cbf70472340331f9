"""Executors run the step the engine core planned on the rank engines and return its logits.

All have the same calls: execute a step's inputs, copy KV blocks, say how many blocks each rank's
KV pool holds, `check()` that the ranks are alive, `sentinels` to wait on while idle, `shutdown()`.
- `UniprocExecutor`: the one rank engine of a single-rank engine dir, in this process;
- `MultiprocExecutor` (multiproc_executor.py): one worker process per rank, on this machine;
- `TorchrunExecutor` (torchrun_executor.py): rank 0 of ranks started by `torchrun -m kiln.launch`,
  across machines.
"""
import os

import torch

from kiln.config import EngineConfig
from kiln.runtime.engine import Engine

# kiln.launch sets it for the engine core of torchrun's rank 0.
EXECUTOR_ENV = "KILN_EXECUTOR"


class EngineDeadError(RuntimeError):
    """The engine core stopped (its process, or one of its ranks, died or was killed): every pending
    and later request fails with this error. vLLM's name; the frontend has to be restarted."""


def make_executor(engine_dir, kv_cache_free_mem_fraction: float | None = None,
                  max_tokens_in_paged_kv_cache: int | None = None, threads: int = 1):
    world = EngineConfig.load(engine_dir).pretrained_config.mapping.world_size
    if world == 1:
        return UniprocExecutor(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache)
    if os.environ.get(EXECUTOR_ENV) == "torchrun":
        from kiln.runtime.torchrun_executor import TorchrunExecutor

        return TorchrunExecutor(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache)
    from kiln.runtime.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache, threads)


class UniprocExecutor:
    sentinels: list = []

    def __init__(self, engine_dir, kv_cache_free_mem_fraction: float | None = None,
                 max_tokens_in_paged_kv_cache: int | None = None):
        self.engine = Engine(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache)
        self.config = self.engine.config
        self.num_blocks = self.engine.num_blocks

    def execute(self, inputs: dict) -> torch.Tensor:
        return self.engine(inputs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.engine.copy_blocks(pairs)

    def check(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
