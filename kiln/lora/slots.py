"""Which LoRA adapter each of the engine's `max_loras` slots holds (kiln/models/lora.py), for the
runtime's scheduler.

A sequence holds its adapter's slot from admission to its end or preemption; a slot no sequence holds
is reused for another adapter, least recently used first, and a sequence whose adapter finds no slot
waits. Read adapters stay in host memory, the `max_cpu_loras` most recently used, so that reloading
a slot does not read the adapter dir again.
"""
from collections import OrderedDict
from typing import Protocol

from kiln.config import EngineConfig
from kiln.lora.adapter import Adapter, read_adapter


# What the slots use of the runtime, which sits above this room (kiln/runtime/core/request.py's
# Sequence, kiln/runtime/executor/base.py's Executor).
class _Request(Protocol):
    lora_request: object  # a LoRARequest (lora_int_id, lora_path), or None for the base model
    lora_slot: int  # the slot its adapter is in while a sequence of it runs, else -1


class _Sequence(Protocol):
    request: _Request


class _Executor(Protocol):
    config: EngineConfig

    def set_lora(self, slot: int, adapter: Adapter) -> None: ...


class LoraSlots:
    def __init__(self, executor: _Executor, max_loras: int, max_cpu_loras: int):
        self.executor = executor
        self.max_cpu_loras = max(max_cpu_loras, 1)
        self.adapters: OrderedDict[int, Adapter] = OrderedDict()  # lora_int_id -> adapter, LRU last
        self.slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self.users = [0] * max_loras  # sequences holding each slot
        self.idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # LRU first

    def acquire(self, seq: _Sequence) -> bool:
        """Give the sequence its adapter's slot (loading it there if needed); False: none is free."""
        lora = seq.request.lora_request
        if lora is None:
            return True
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is None:
            if not self.idle:
                return False
            slot = next(iter(self.idle))
            self.slot_of = {i: s for i, s in self.slot_of.items() if s != slot}
            self.executor.set_lora(slot, self._adapter(lora))
            self.slot_of[lora.lora_int_id] = slot
        self.idle.pop(slot, None)
        self.users[slot] += 1
        seq.request.lora_slot = slot
        return True

    def release(self, seq: _Sequence) -> None:
        lora = seq.request.lora_request
        if lora is None or seq.request.lora_slot < 0:
            return
        slot = seq.request.lora_slot
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self.idle[slot] = None

    def counts(self) -> tuple[int, int, int]:
        """(slots holding an adapter, slots a running sequence holds, slots)."""
        return len(self.slot_of), sum(u > 0 for u in self.users), len(self.users)

    def _adapter(self, lora) -> Adapter:
        adapter = self.adapters.pop(lora.lora_int_id, None) or read_adapter(lora.lora_path,
                                                                             self.executor.config.pretrained_config)
        self.adapters[lora.lora_int_id] = adapter
        while len(self.adapters) > self.max_cpu_loras:
            self.adapters.popitem(last=False)
        return adapter
