"""The executor layer: what the engine core asks of whatever runs its steps on the rank engines.

- `UniprocExecutor` (uniproc.py): the one rank engine of a single-rank engine dir, in this process;
- `MultiprocExecutor` (multiproc.py): one worker process per rank (worker.py), on this machine;
- `TorchrunExecutor` (torchrun.py): rank 0 of ranks started by `torchrun -m kiln.launch`, across
  machines.
factory.py picks one for an engine dir. Under them: worker.py (a rank's process and its part of a
step), shm_ring.py (the step and logits messages in shared memory), distributed.py (the ranks'
process groups).
"""
from abc import ABC, abstractmethod
from collections import deque

import torch

from kiln.config import EngineConfig
from kiln.lora.adapter import Adapter


class Executor(ABC):
    """Runs each step's inputs (kiln/engine/format.py) on every rank and returns the logits. An
    executor whose rank dies raises EngineDeadError (kiln/runtime/messages.py) from then on."""

    config: EngineConfig
    num_blocks: int  # the KV blocks every rank's pool holds (the ranks agree on one size)
    # Steps that may be submitted before the oldest is collected: more than one only where the ranks
    # overlap them (a pipeline's stages, each on its own step).
    max_concurrent_batches: int = 1

    def __init__(self):
        self._results: deque[torch.Tensor] = deque()  # of steps run by submit(), not yet collected

    @abstractmethod
    def execute(self, inputs: dict) -> torch.Tensor:
        """One step: its logits."""

    def submit(self, inputs: dict) -> None:
        """Send a step without waiting for its logits (here: run it now; collect() hands them back)."""
        self._results.append(self.execute(inputs))

    def collect(self) -> torch.Tensor:
        """The logits of the oldest step submitted and not yet collected."""
        return self._results.popleft()

    @abstractmethod
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks src -> dst on every rank, before the next step reads them."""

    @abstractmethod
    def set_lora(self, slot: int, adapter: Adapter) -> None:
        """Load the adapter into LoRA slot `slot` (kiln/lora/slots.py picks it), each rank its share
        (kiln/lora/shard.py), before the next step reads it. LoRA engines only."""

    def check(self) -> None:
        """Raises EngineDeadError if a rank has died (none can die apart from this process here)."""

    @property
    def sentinels(self) -> list:
        """What turns readable when a rank dies: the engine core waits on these, and on its pipe,
        while idle."""
        return []

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank; the executor is unusable after."""
