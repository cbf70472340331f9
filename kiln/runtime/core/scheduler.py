"""In-flight batching: which sequences run this step, and how many of their tokens.

Every step has a token budget (`max_num_tokens`) shared by decodes and prefill chunks. Running
sequences go first, in arrival order; waiting ones are admitted while budget, batch slots and KV
blocks last. A prompt longer than the remaining budget is prefilled in chunks over several steps.

Policies (TensorRT-LLM's names):
- `max_utilization`: admit whenever the next chunk fits; when a running sequence cannot get a block,
  preempt the most recently admitted sequence (free its blocks, recompute it later).
- `guaranteed_no_evict`: admit only when blocks for the whole sequence (prompt + max_tokens, for
  each of its n samples) can be reserved; never preempts.

A sequence in a step still in flight (pipeline parallel: the engine core keeps up to pp_size steps
in flight) is neither scheduled nor preempted until that step's tokens are back.
"""
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from kiln.runtime.core.kv_cache_manager import KVCacheManager
from kiln.runtime.core.request import Request, Sequence, Status

POLICIES = ("max_utilization", "guaranteed_no_evict")


@dataclass
class SchedulerCounters:
    """Cumulative since the engine started (vLLM's prefix cache counters count tokens)."""
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens of the sequences admitted
    prefix_cache_hits: int = 0  # of those, found in the prefix cache


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batch_size: int, max_num_tokens: int,
                 max_seq_len: int, policy: str = "max_utilization", enable_chunked_prefill: bool = True,
                 loras=None):
        if policy not in POLICIES:
            raise ValueError(f"scheduler policy {policy!r} is not supported; expected one of {', '.join(POLICIES)}")
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.max_seq_len = max_seq_len
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.loras = loras  # LoRA engines: the adapter slots (kiln/lora/slots.py), held by running sequences
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()

    def add(self, request: Request) -> None:
        self.waiting.extend(request.sequences)

    def schedule(self, max_seqs: int | None = None, in_flight: Collection[Sequence] = ()) -> SchedulerOutput:
        """max_seqs: fewer sequences than max_batch_size in this step (a pipeline's micro-batch);
        in_flight: sequences of steps not yet collected, left alone."""
        out = SchedulerOutput()
        budget = self.max_num_tokens
        limit = self.max_batch_size if max_seqs is None else min(max_seqs, self.max_batch_size)
        # Blocks kept free for forks to come: of sequences scheduled earlier in this step, and of
        # unforked ones whose step is in flight (pipeline parallel: it may end their prompt, and
        # their fork copies into these blocks when it is collected).
        held = sum(s.request.params.num_sequences - 1 for s in in_flight
                   if not s.request.forked and not s.reserved_blocks and not s.finished)
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < limit:
            seq = self.running[i]
            if seq in in_flight or seq.num_computed_tokens == seq.num_tokens:  # or a beam waiting for the others
                i += 1
                continue
            if self.kv.restart_with_long_rope(seq):  # prefilled again below, with the long factors
                seq.draft_token_ids = []
            if seq.draft_token_ids:  # the last token and the drafts, if they fit without evicting anyone
                n = 1 + len(seq.draft_token_ids)
                if n <= budget and self.kv.allocate_slots(seq, n, held):
                    out.scheduled.append((seq, n))
                    budget -= n
                    i += 1
                    continue
                seq.draft_token_ids = []
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            headroom = self._fork_headroom(seq, n)
            while not self.kv.allocate_slots(seq, n, held + headroom):
                if self.policy == "guaranteed_no_evict":  # admission reserved every block it needs
                    raise RuntimeError(f"KV cache reservation broken for request {seq.request.request_id}")
                # The latest admitted not in flight goes first: at worst seq itself, so never one
                # already scheduled in this step.
                victim = next(s for s in reversed(self.running) if s not in in_flight)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                held += headroom
                budget -= n
                i += 1
        if out.preempted:
            return out
        # Batch slots taken: a running request that has not forked yet will hold n (or its beams) of them.
        occupied = sum(1 if s.request.forked else s.request.params.num_sequences for s in self.running)
        while self.waiting and budget > 0 and len(out.scheduled) < limit:
            seq = self.waiting[0]
            width = 1 if seq.request.forked else seq.request.params.num_sequences
            if occupied + width > self.max_batch_size:
                break
            cached = self.kv.take_cached(seq)  # the longest cached prefix: computed already
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget and not self.enable_chunked_prefill:
                self._unadmit(seq)
                break
            n = min(n, budget)
            # every new sequence reserves (an n=1 request is `forked` from the start)
            if self.policy == "guaranteed_no_evict" and seq.reserved_blocks == 0:
                req = seq.request
                total, _ = self.kv.request_blocks(req.num_prompt_tokens, req.max_len, req.params.num_sequences)
                if not self.kv.reserve(seq, total - len(seq.block_table)):  # less the prefix cache's hits
                    self._unadmit(seq)
                    break
            headroom = self._fork_headroom(seq, n)
            if not self.kv.allocate_slots(seq, n, held + headroom):
                self._unadmit(seq)
                break
            if self.loras is not None and not self.loras.acquire(seq):  # every slot busy with other adapters
                self._unadmit(seq)
                break
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = cached
            self.counters.prefix_cache_queries += seq.num_tokens
            self.counters.prefix_cache_hits += cached
            held += headroom
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            occupied += width
            out.scheduled.append((seq, n))
            budget -= n
        return out

    def _fork_headroom(self, seq: Sequence, n: int) -> int:
        """Blocks the n-1 sibling samples (or beams) will copy their partly filled last block into at fork."""
        req, width = seq.request, seq.request.params.num_sequences
        if req.forked or width == 1 or seq.num_computed_tokens + n < seq.num_tokens:
            return 0
        if seq.reserved_blocks:
            return 0  # the reservation covers the siblings
        return width - 1

    def _unadmit(self, seq: Sequence) -> None:
        """It stays waiting: the cached blocks it took go back (still cached), its reservation too."""
        if seq.block_table or seq.reserved_blocks:
            self.kv.free(seq)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute later: drop its KV and put it first in line, prompt and output kept."""
        self.running.remove(seq)
        self.kv.free(seq)
        if self.loras is not None:
            self.loras.release(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.counters.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            if self.loras is not None:
                self.loras.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = Status.FINISHED

    def add_forked(self, seqs: list[Sequence]) -> None:
        """Siblings forked from a running sequence join it in the running set."""
        for seq in seqs:
            seq.status = Status.RUNNING
            self.running.append(seq)
            if self.loras is not None:
                self.loras.acquire(seq)  # the parent's slot, held once more
