"""The executor of a multi-rank engine whose ranks torchrun started, on one machine or many
(`torchrun ... -m kiln.launch serve|run ...`, kiln/launch.py).

Rank 0 is the engine core: it schedules, runs rank 0's engine in its own process and broadcasts each
step's encoded inputs to the other ranks through the world process group (gloo); the last stage's
tp rank 0 sends the logits back when that is not rank 0 itself. The other ranks run `serve_rank`:
join, load, then run every step rank 0 broadcasts until it says stop.

Loading is collective: rank 0 broadcasts the KV cache settings, every rank loads its engine and
all report (their pool size, or why they failed) to all, so a rank that cannot load fails the start
on every rank with its message. A rank that dies makes the next collective fail on the others; rank 0
then raises EngineDeadError and torchrun stops the job.
"""
import os

import torch
import torch.distributed as dist

from kiln.config import ConfigError, EngineConfig
from kiln.engine.format import warmup_inputs
from kiln.lora.adapter import Adapter
from kiln.runtime.executor.base import Executor
from kiln.runtime.executor.shm_ring import decode, encode
from kiln.runtime.executor.worker import RankWorker, error_report
from kiln.runtime.messages import EngineDeadError
from kiln.threads import configure_threads


def _broadcast(message: bytearray | None = None):
    """Rank 0's encoded message (given there) on every rank."""
    size = torch.tensor([len(message) if message is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0)
    buf = (torch.frombuffer(message, dtype=torch.uint8) if message is not None
           else torch.empty(int(size), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return buf.numpy()


def _ranks_per_machine() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _load(worker: RankWorker, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache) -> int:
    """Every rank loads its engine; the KV pool size all can hold, or every rank raises the first
    failure."""
    try:
        status = (worker.load(kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache, _ranks_per_machine()), None)
    except Exception as e:  # noqa: BLE001 - reported to every rank
        status = (None, error_report(worker.rank, e))
    statuses = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, status)
    for blocks, error in statuses:
        if error is not None:
            raise (ConfigError if error[0] == "ConfigError" else RuntimeError)(f"failed to load {error[1]}")
    num_blocks = min(blocks for blocks, _ in statuses)
    worker.engine.allocate(num_blocks)
    return num_blocks


class TorchrunExecutor(Executor):
    def __init__(self, engine_dir, kv_cache_free_mem_fraction: float | None = None,
                 max_tokens_in_paged_kv_cache: int | None = None):
        super().__init__()
        self.config = EngineConfig.load(engine_dir)
        m = self.config.pretrained_config.mapping
        world, rank = int(os.environ.get("WORLD_SIZE", 0)), int(os.environ.get("RANK", -1))
        if world != m.world_size or rank != 0:
            raise ConfigError(f"{engine_dir} has {m.world_size} ranks (tp {m.tp_size} x pp {m.pp_size}); this is "
                              f"rank {rank} of {world} torchrun processes: launch exactly {m.world_size}")
        self.result_rank = (m.pp_size - 1) * m.tp_size
        self.dead: EngineDeadError | None = None
        self._copies: list[tuple[int, int]] = []
        self.worker = RankWorker(engine_dir, 0)
        try:
            _broadcast(encode("load", {k: torch.tensor(v) for k, v in dict(
                kv_cache_free_mem_fraction=kv_cache_free_mem_fraction,
                max_tokens_in_paged_kv_cache=max_tokens_in_paged_kv_cache).items() if v is not None}))
            self.num_blocks = _load(self.worker, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache)
            self.execute(warmup_inputs())
        except BaseException:
            self.worker.close()
            raise

    # sentinels: none. torchrun watches the processes; a dead rank fails the next collective.

    def check(self) -> None:
        if self.dead is not None:
            raise self.dead

    def execute(self, inputs: dict) -> torch.Tensor:
        self.check()
        if self._copies:
            inputs = {**inputs, "copy_blocks": torch.tensor(self._copies, dtype=torch.int64)}
            self._copies = []
        try:
            _broadcast(encode("step", inputs))
            logits = self.worker.execute(dict(inputs))
            if self.result_rank != 0:
                shape = self.worker.groups.recv((2,), torch.int64, self.result_rank)
                logits = self.worker.groups.recv(tuple(shape.tolist()), torch.float32, self.result_rank)
            return logits
        except RuntimeError as e:  # gloo: a rank is gone (its connection closed) or timed out
            self.dead = EngineDeadError(f"the engine died: {str(e).strip().splitlines()[0] if str(e).strip() else e}")
            raise self.dead from None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._copies.extend(pairs)

    def set_lora(self, slot: int, adapter: Adapter) -> None:
        # make_executor refuses LoRA engines under torchrun: rank 0 does not broadcast max_loras (the
        # other ranks' pools would have the default's slots) and its steps carry no adapter loads.
        raise ConfigError("LoRA engines under torchrun are not supported yet")

    def shutdown(self) -> None:
        if self.dead is None:
            try:
                _broadcast(encode("stop"))
            except RuntimeError:
                pass
            self.dead = EngineDeadError("the engine was shut down")
        self.worker.close()


def serve_rank(engine_dir) -> int:
    """A rank other than 0 under torchrun: load, then run rank 0's steps until it says stop."""
    configure_threads()
    rank = int(os.environ["RANK"])
    worker = RankWorker(engine_dir, rank)
    settings = {k: v.item() for k, v in decode(_broadcast())[1].items()}
    _load(worker, settings.get("kv_cache_free_mem_fraction"), settings.get("max_tokens_in_paged_kv_cache"))
    while True:
        kind, inputs = decode(_broadcast())
        if kind == "stop":
            break
        logits = worker.execute(inputs)
        if logits is not None and rank != 0:
            worker.groups.send(torch.tensor(logits.shape, dtype=torch.int64), 0)
            worker.groups.send(logits, 0)
    worker.close()
    return 0
