"""Tensor parallelism applied to one rank's model (Megatron's layout, as TensorRT-LLM's).

qkv and fc/gate are column-parallel (each rank holds its heads and its share of the MLP), dense and
proj row-parallel: their partial outputs are summed across the ranks by an all-reduce inside the
rank's compiled step. The embedding and lm_head are split along the vocabulary: each rank looks up
the ids it holds (zeros elsewhere) and the all-reduce completes the rows; each rank's logits for its
vocabulary slice are gathered, for the logits_index rows only.

The collectives are kiln_cpp ops (kiln/plugins/csrc/all_reduce.cpp) on the group named TP_GROUP:
through shared memory where the runtime attached a communicator under that name (every rank of the
group on one machine), else through the torch.distributed process group registered under it. The
engine bakes the name in; the runtime (kiln/runtime/executor/distributed.py) provides the group.
"""
import torch

from kiln.config import PretrainedConfig

TP_GROUP = "kiln_tp"


class TensorParallel:
    def __init__(self, config: PretrainedConfig, rank: int):
        self.size = config.mapping.tp_size
        self.vocab_part = config.vocab_size_padded // self.size
        self.vocab_start = config.mapping.tp_rank(rank) * self.vocab_part
        if self.size > 1:
            from kiln.plugins import cpp

            cpp.load()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else torch.ops.kiln_cpp.all_reduce(x, TP_GROUP)

    def embedding(self, lookup, ids: torch.Tensor) -> torch.Tensor:
        """lookup(local ids) -> rows of this rank's vocabulary slice; the rows of every id."""
        if self.size == 1:
            return lookup(ids)
        local = ids - self.vocab_start
        held = (local >= 0) & (local < self.vocab_part)
        rows = lookup(torch.where(held, local, 0))
        return self.all_reduce(torch.where(held[:, None], rows, 0))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, vocab slice] on each rank -> [N, padded vocab], the slices in rank order."""
        if self.size == 1:
            return logits
        n = logits.shape[0]
        parts = torch.ops.kiln_cpp.all_gather(logits, self.size, TP_GROUP)  # [size * N, slice]
        return parts.view(self.size, n, -1).transpose(0, 1).reshape(n, -1)
