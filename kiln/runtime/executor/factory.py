"""Which executor runs an engine dir: its rank in this process, a worker process per rank, or the
ranks torchrun started (kiln.launch says so in the environment)."""
import os

from kiln.config import ConfigError, EngineConfig
from kiln.runtime.executor.base import Executor
from kiln.runtime.executor.multiproc import MultiprocExecutor
from kiln.runtime.executor.torchrun import TorchrunExecutor
from kiln.runtime.executor.uniproc import UniprocExecutor

# kiln.launch sets it for the engine core of torchrun's rank 0.
EXECUTOR_ENV = "KILN_EXECUTOR"


def make_executor(engine_dir, kv_cache_free_mem_fraction: float | None = None,
                  max_tokens_in_paged_kv_cache: int | None = None, threads: int = 1, max_loras: int = 4) -> Executor:
    config = EngineConfig.load(engine_dir)
    world = config.pretrained_config.mapping.world_size
    if world == 1:
        return UniprocExecutor(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache, max_loras)
    if os.environ.get(EXECUTOR_ENV) == "torchrun":
        if config.build_config.lora_config is not None:
            raise ConfigError(f"{engine_dir}: LoRA engines under torchrun are not supported yet; run its ranks in "
                              f"worker processes on one machine (kiln serve / LLM without kiln.launch)")
        return TorchrunExecutor(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache)
    return MultiprocExecutor(engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache, threads,
                             max_loras)
