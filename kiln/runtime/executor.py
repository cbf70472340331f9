"""Executors run the step the engine core planned on the rank engines and return its logits.

`UniprocExecutor` holds the one rank engine of a single-rank engine dir in this process. A
multi-rank executor (one worker process per rank) fits the same three calls: execute a step's
inputs, copy KV blocks, and say how many blocks each rank's KV pool holds.
"""
import torch

from kiln.runtime.engine import Engine


class UniprocExecutor:
    def __init__(self, engine_dir, kv_cache_free_mem_fraction: float | None = None,
                 max_tokens_in_paged_kv_cache: int | None = None):
        self.engine = Engine(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache)
        self.config = self.engine.config
        self.num_blocks = self.engine.num_blocks

    def execute(self, inputs: dict) -> torch.Tensor:
        return self.engine(inputs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.engine.copy_blocks(pairs)
