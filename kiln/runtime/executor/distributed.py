"""torch.distributed for the ranks of a multi-rank engine: one process per rank, gloo groups.

Every rank joins the world group (control: the step inputs under torchrun, the KV pool's size) and
a second world-sized group for the stages' point-to-point sends (hidden states forward, logits to
rank 0), so that sends never interleave with collectives on one group. Each pipeline stage's ranks
form a tensor-parallel group, registered under the name the engines bake in
(kiln.models.parallel.TP_GROUP); where every rank of it is on one machine (one torchrun node), a
shared-memory communicator is attached under the same name and the engines' collectives use it
instead of gloo ($KILN_TP_SHM=0 keeps gloo, to compare them).
"""
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from kiln.config import BuildConfig, Mapping, PretrainedConfig
from kiln.models.parallel import TP_GROUP
from kiln.plugins import cpp
from kiln.runtime.executor.shm_ring import SHM, sweep

# How long a collective waits for a rank that is alive but silent (a rank that dies ends it at once).
TIMEOUT = timedelta(seconds=float(os.environ.get("KILN_DISTRIBUTED_TIMEOUT", 600)))


class RankGroups:
    def __init__(self, pretrained: PretrainedConfig, build: BuildConfig, rank: int, store=None):
        """store: the rendezvous (a TCPStore); None: torchrun's environment (env://)."""
        m: Mapping = pretrained.mapping
        self.rank, self.mapping = rank, m
        self.pp_rank, self.tp_rank = m.pp_rank(rank), m.tp_rank(rank)
        if store is None:
            dist.init_process_group("gloo", timeout=TIMEOUT)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=m.world_size, timeout=TIMEOUT)
        assert dist.get_rank() == rank and dist.get_world_size() == m.world_size, (dist.get_rank(), rank)
        self.p2p = dist.new_group(backend="gloo")
        # Every rank creates every group (new_group is collective), then keeps its own.
        stages = [dist.new_group(list(range(s * m.tp_size, (s + 1) * m.tp_size)), backend="gloo")
                  for s in range(m.pp_size)]
        self.tp = stages[self.pp_rank]
        self.shm = False
        if m.tp_size > 1:
            _register(TP_GROUP, self.tp)
            # torchrun's node (GROUP_RANK): ranks launched by one agent share a machine.
            nodes = [None] * m.world_size
            dist.all_gather_object(nodes, os.environ.get("GROUP_RANK", socket.gethostname()))
            stage = range(self.pp_rank * m.tp_size, (self.pp_rank + 1) * m.tp_size)
            if len({nodes[r] for r in stage}) == 1 and os.environ.get("KILN_TP_SHM", "1") != "0":
                self._attach_shm(pretrained, build)

    def _attach_shm(self, pretrained: PretrainedConfig, build: BuildConfig) -> None:
        cpp.load()
        key = [str(SHM / f"kiln-{os.getpid()}-tp{self.pp_rank}-{os.urandom(4).hex()}")
               if self.tp_rank == 0 else None]
        dist.broadcast_object_list(key, src=self.pp_rank * self.mapping.tp_size, group=self.tp)
        if self.tp_rank == 0:
            sweep()
        # A round carries the largest hidden-state all-reduce of a step or the logits of a batch
        # of decodes; larger tensors take several rounds.
        itemsize = torch.finfo(getattr(torch, pretrained.dtype)).bits // 8
        slot = max(build.max_num_tokens * pretrained.hidden_size * itemsize,
                   build.max_batch_size * (pretrained.vocab_size_padded // self.mapping.tp_size) * 4)
        slot = min(-(-slot // 64) * 64, 4 << 20)
        torch.ops.kiln_cpp.shm_attach(TP_GROUP, key[0], self.tp_rank, self.mapping.tp_size, slot)
        dist.barrier(group=self.tp)
        if self.tp_rank == 0:
            os.unlink(key[0])  # every rank has it mapped: nothing is left in /dev/shm, whatever happens
        self.shm = True

    def send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t.contiguous(), dst, group=self.p2p)

    def recv(self, shape, dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        dist.recv(t, src, group=self.p2p)
        return t

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if self.shm:
            torch.ops.kiln_cpp.shm_detach(TP_GROUP)
        if self.mapping.tp_size > 1:
            _unregister(TP_GROUP)
        if dist.is_initialized():
            dist.destroy_process_group()


def _register(name: str, group) -> None:
    _unregister(name)
    torch._C._distributed_c10d._register_process_group(name, group)


def _unregister(name: str) -> None:
    try:
        torch._C._distributed_c10d._unregister_process_group(name)
    except Exception:  # noqa: BLE001 - not registered
        pass
