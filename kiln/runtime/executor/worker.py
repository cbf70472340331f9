"""One rank of a multi-rank engine: its rank engine and KV pool shard, and its part of each step.

A stage after the first receives its hidden states from the stage before (the rank with the same
tp rank), a stage before the last sends them on; the last stage's ranks compute the logits (the
tensor-parallel ranks gather them inside the engine) and its tp rank 0 returns them. Every rank gets
the same step inputs, block tables included: its KV pool holds its own heads and layers of the same
blocks.

`python -m kiln.runtime.executor.worker` is a rank's process under the multiprocess executor
(multiproc.py): it reads each message the executor broadcasts through the
shared-memory ring, one per byte on its wake pipe, and answers on its reply pipe.
"""
import json
import os
import signal
import sys
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from kiln.config import EngineConfig, torch_dtype
from kiln.engine.loader import RankEngine
from kiln.lora.adapter import read_adapter
from kiln.lora.shard import rank_weights
from kiln.runtime.executor.distributed import RankGroups
from kiln.runtime.executor.shm_ring import ShmRing, encode
from kiln.threads import configure_threads


class RankWorker:
    """Joins the ranks' groups (store: a TCPStore; None: torchrun's environment); load() then loads
    the rank engine, its KV pool left to allocate() once the ranks agree on its size."""

    def __init__(self, engine_dir, rank: int, store=None):
        config = EngineConfig.load(engine_dir)
        self.engine_dir, self.pretrained = engine_dir, config.pretrained_config
        m = self.pretrained.mapping
        self.rank, self.tp_size = rank, m.tp_size
        self.pp_rank = m.pp_rank(rank)
        self.is_last = self.pp_rank == m.pp_size - 1
        self.returns_logits = self.is_last and m.tp_rank(rank) == 0
        self.groups = RankGroups(self.pretrained, config.build_config, rank, store)
        self.engine: RankEngine | None = None

    def load(self, kv_cache_free_mem_fraction=None, max_tokens_in_paged_kv_cache=None, ranks_per_machine: int = 1,
             max_loras: int = 4):
        """This rank's engine; returns the KV blocks it could hold."""
        self.engine = RankEngine(self.engine_dir, kv_cache_free_mem_fraction, max_tokens_in_paged_kv_cache,
                                 rank=self.rank, ranks_per_machine=ranks_per_machine, allocate=False,
                                 max_loras=max_loras)
        return self.engine.num_blocks

    def set_lora(self, slot: int, adapter_dir: str) -> None:
        lora_config = self.engine.config.build_config.lora_config
        adapter = read_adapter(adapter_dir, self.pretrained)
        self.engine.set_lora(slot, rank_weights(adapter, self.pretrained, lora_config, self.rank))

    def execute(self, inputs: dict) -> torch.Tensor | None:
        """Logits on the rank that returns them, else None."""
        copies = inputs.pop("copy_blocks", None)
        if copies is not None:
            self.engine.copy_blocks(copies.tolist())
        loras = inputs.pop("set_lora", None)
        for line in [] if loras is None else bytes(loras.tolist()).decode().split("\n"):
            slot, adapter_dir = line.split("\t", 1)
            self.set_lora(int(slot), adapter_dir)
        hidden = None
        if self.pp_rank > 0:
            shape = (inputs["input_ids"].shape[0], self.pretrained.hidden_size)
            hidden = self.groups.recv(shape, torch_dtype(self.pretrained.dtype), self.rank - self.tp_size)
        out = self.engine(inputs, hidden)
        if not self.is_last:
            self.groups.send(out, self.rank + self.tp_size)
            return None
        return out if self.returns_logits else None

    def close(self) -> None:
        self.groups.close()


def error_report(rank: int, e: BaseException) -> tuple[str, str]:
    reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return type(e).__name__, f"rank {rank} (pid {os.getpid()}): {reason or type(e).__name__}"


def main(spec: dict, wake_fd: int, reply: Connection) -> int:
    rank = spec["rank"]
    try:
        configure_threads(spec["threads"])
        steps = ShmRing.attach(spec["steps"], *spec["steps_size"])
        store = dist.TCPStore("127.0.0.1", spec["port"], is_master=False, timeout=timedelta(seconds=60))
        worker = RankWorker(spec["engine_dir"], rank, store)
        blocks = worker.load(spec["kv_cache_free_mem_fraction"], spec["max_tokens_in_paged_kv_cache"],
                             spec["world_size"], spec["max_loras"])
        results = ShmRing.attach(spec["results"], *spec["results_size"]) if worker.returns_logits else None
        reply.send(("loaded", blocks))
    except Exception as e:  # noqa: BLE001 - the executor fails the start with this rank's message
        reply.send(("failed", *error_report(rank, e)))
        return 1
    n = returned = 0
    try:
        while os.read(wake_fd, 1):  # b"": the executor's process is gone
            kind, tensors = steps.read(n)
            n += 1
            if kind == "stop":
                break
            if kind == "allocate":
                worker.engine.allocate(int(tensors["num_blocks"]))
                continue
            out = worker.execute(tensors)
            if results is not None:  # the executor reads result r from slot r, in order
                out = {"logits": out[0], "captured": out[1]} if isinstance(out, tuple) else {"logits": out}
                fits = results.write(returned, "logits", out)
                returned += 1
                reply.send(("result", None if fits else encode("logits", out)))
    except Exception as e:  # noqa: BLE001 - a rank that fails a step takes the engine down
        reply.send(("error", *error_report(rank, e)))
        return 1
    worker.close()
    return 0


if __name__ == "__main__":  # python -m kiln.runtime.executor.worker SPEC_JSON WAKE_FD REPLY_FD
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the process group; the executor decides
    sys.exit(main(json.loads(sys.argv[1]), int(sys.argv[2]), Connection(int(sys.argv[3]))))
