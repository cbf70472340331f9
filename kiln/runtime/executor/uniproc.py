"""The executor of a single-rank engine: its rank engine in this process."""
import torch

from kiln.engine.loader import RankEngine
from kiln.lora.adapter import Adapter
from kiln.lora.shard import rank_weights
from kiln.runtime.executor.base import Executor


class UniprocExecutor(Executor):
    def __init__(self, engine_dir, kv_cache_free_mem_fraction: float | None = None,
                 max_tokens_in_paged_kv_cache: int | None = None, max_loras: int = 4):
        super().__init__()
        self.engine = RankEngine(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache,
                                 max_loras=max_loras)
        self.config = self.engine.config
        self.num_blocks = self.engine.num_blocks

    def execute(self, inputs: dict) -> torch.Tensor:
        return self.engine(inputs)

    def set_lora(self, slot: int, adapter: Adapter) -> None:
        build = self.config.build_config
        self.engine.set_lora(slot, rank_weights(adapter, self.config.pretrained_config, build.lora_config, 0))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.engine.copy_blocks(pairs)

    def shutdown(self) -> None:
        pass
