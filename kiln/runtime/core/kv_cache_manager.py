"""Gives sequences the KV blocks their tokens need; knows nothing of scheduling policy.

With prefix caching on, a sequence admitted from the queue first takes the cached blocks of its
longest cached prefix (full blocks only, never the one holding its last token, whose logits must
be computed), and each block it fills is added to the cache once its K/V are computed.

A model whose every layer slides a window over the keys (`window`) never reads a block again once
it lies wholly before the window of the sequence's next query: such blocks go back to the pool as
the sequence grows (still findable by the prefix cache until reused), and their entries in the
sequence's block table become -1 (the attention kernels start at the window's first block), so the
blocks a sequence holds stay bounded by its window however long it generates.

LongRoPE (Phi-3.5, Phi-4-mini) rotates the keys of a sequence up to `long_rope_threshold` tokens long
with its short factors and those of a longer one with its long factors. HF recomputes a sequence's
keys when it first grows past the threshold; so does Kiln (`restart_with_long_rope`): its blocks go
back to the pool and it is prefilled again from its first token. Blocks are hashed with the factors
their keys were rotated with, so the prefix cache never mixes them.

Each sequence holding blocks also has a row of `block_tables`, a tensor copy of its block table
kept in step with it as blocks are added, so that a step's tables are gathered from rows instead of
being built from Python lists every step (kiln/runtime/core/step_plan.py).
"""
import torch

from kiln.runtime.core.block_pool import NONE, BlockHasher, BlockPool
from kiln.runtime.core.request import Sequence
from kiln.runtime.messages import blocks_for, request_blocks


class KVCacheManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, max_seqs: int, max_blocks_per_seq: int,
                 enable_prefix_caching: bool = True, prefix_cache_seed: int | None = None, window: int = 0,
                 long_rope_threshold: int = 0):
        self.pool = BlockPool(num_blocks)
        self.window = window
        self.long_rope_threshold = long_rope_threshold
        self.tokens_per_block = tokens_per_block
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = BlockHasher(prefix_cache_seed)
        self.reserved = 0  # promised to admitted sequences (guaranteed_no_evict), not yet allocated
        self.block_tables = torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int32)
        self.free_rows = list(range(max_seqs - 1, -1, -1))

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.tokens_per_block)

    def request_blocks(self, num_prompt_tokens: int, max_len: int, n: int) -> tuple[int, int]:
        return request_blocks(num_prompt_tokens, max_len, n, self.tokens_per_block, self.long_rope_threshold)

    @property
    def num_available(self) -> int:
        return self.pool.num_free - self.reserved

    def reserve(self, seq: Sequence, num_blocks: int) -> bool:
        if num_blocks > self.num_available:
            return False
        seq.reserved_blocks += num_blocks
        self.reserved += num_blocks
        return True

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, headroom: int = 0) -> bool:
        """Make room for K/V of `num_new_tokens` more tokens, leaving `headroom` blocks free beside;
        False (nothing taken) if the pool is short."""
        self._drop_behind_window(seq)
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        from_reserve = min(max(need, 0), seq.reserved_blocks)
        if max(need, 0) - from_reserve + headroom > self.num_available:
            return False
        if need <= 0:
            return True
        seq.reserved_blocks -= from_reserve
        self.reserved -= from_reserve
        self._append(seq, self.pool.allocate(need))
        return True

    def _drop_behind_window(self, seq: Sequence) -> None:
        """Release the blocks wholly before the window of the sequence's next query (at position
        num_computed_tokens; computed tokens are never taken back past that)."""
        if not self.window:
            return
        end = min(max(0, seq.num_computed_tokens - self.window + 1) // self.tokens_per_block, len(seq.block_table))
        if end == 0 or seq.block_table[end - 1] < 0:
            return
        self.cache_full_blocks(seq)  # they stay findable by their hashes until reused
        table = seq.block_table
        start = end - 1
        while start > 0 and table[start - 1] >= 0:
            start -= 1
        self.pool.release(table[start:end])
        table[start:end] = [-1] * (end - start)
        self.block_tables[seq.row, start:end] = -1

    # -- the prefix cache ---------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of the sequence's first num_blocks full blocks (kept on it: its
        tokens never change, so a preempted sequence does not hash them again)."""
        tpb, hashes = self.tokens_per_block, seq.block_hashes
        for i in range(len(hashes), num_blocks):
            hashes.append(self.hasher(hashes[-1] if hashes else NONE, seq.token_ids[i * tpb:(i + 1) * tpb],
                                      seq.request.extra_keys + (("long_rope",) if seq.long_rope else ())))
        return hashes[:num_blocks]

    def take_cached(self, seq: Sequence) -> int:
        """A sequence holding no blocks takes those of its longest cached prefix; returns the tokens
        they hold (now computed)."""
        if seq.block_table:
            return 0
        long_rope = 0 < self.long_rope_threshold < seq.num_tokens
        if long_rope != seq.long_rope:  # its K/V will be rotated differently: other hashes
            seq.long_rope, seq.block_hashes = long_rope, []
        if not self.enable_prefix_caching:
            return 0
        limit = min(seq.num_tokens - 1, seq.request.cacheable_tokens)
        hits = self.pool.lookup(self._hashes(seq, limit // self.tokens_per_block))
        self.pool.take(hits)
        if hits:
            self._append(seq, hits)
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.tokens_per_block
        return seq.num_computed_tokens

    def restart_with_long_rope(self, seq: Sequence) -> bool:
        """Whether the sequence, its K/V rotated with LongRoPE's short factors, has grown past the
        threshold: then it gives back its blocks (still findable by their hashes) and starts again from
        its first token (or its longest prefix cached with the long factors)."""
        if seq.long_rope or not 0 < self.long_rope_threshold < seq.num_tokens or not seq.block_table:
            return False
        self.cache_full_blocks(seq)
        self.pool.release(seq.block_table)
        seq.block_table, seq.num_cached_blocks, seq.num_computed_tokens = [], 0, 0
        self.take_cached(seq)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Add the blocks the sequence has filled and computed since the last call to the cache."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.tokens_per_block, len(seq.block_table))
        if full > seq.num_cached_blocks:
            hashes = self._hashes(seq, full)
            for i in range(seq.num_cached_blocks, full):
                if seq.block_table[i] >= 0:  # not dropped behind a sliding window
                    self.pool.cache(seq.block_table[i], hashes[i])
            seq.num_cached_blocks = full

    def _append(self, seq: Sequence, blocks: list[int]) -> None:
        if seq.row < 0:
            assert self.free_rows, "more sequences hold blocks than the batch has rows"
            seq.row = self.free_rows.pop()
        start = len(seq.block_table)
        seq.block_table.extend(blocks)
        self.block_tables[seq.row, start:start + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            seq.row = -1
        self.reserved -= seq.reserved_blocks
        seq.reserved_blocks = 0

    def split_reservation(self, seq: Sequence, siblings: list[Sequence]) -> None:
        """guaranteed_no_evict: sequences made from `seq` (n > 1 samples, new beams) each take their
        own share of the reservation it holds for the whole request."""
        if seq.reserved_blocks:
            req = seq.request
            own = self.request_blocks(req.num_prompt_tokens, req.max_len, 1)[1]
            for s in siblings:
                seq.reserved_blocks -= own
                s.reserved_blocks = own

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share the parent's blocks with a child. A partly filled last block is copied instead,
        since both will append to it: returns (src, dst) of that copy for the executor to do."""
        full = parent.num_computed_tokens // self.tokens_per_block
        shared = parent.block_table[:full]
        self.pool.share(shared)
        child.block_hashes = list(parent.block_hashes)  # the same tokens so far
        child.num_cached_blocks = min(parent.num_cached_blocks, full)
        if full == len(parent.block_table):
            self._append(child, shared)
            return None
        if child.reserved_blocks:
            child.reserved_blocks -= 1
            self.reserved -= 1
        dst = self.pool.allocate(1)[0]
        self._append(child, shared + [dst])
        return parent.block_table[full], dst

    def reassign(self, beams: list[Sequence], parents: list[int]) -> list[tuple[int, int]]:
        """Beam search: beams[i] continues beams[parents[i]] (parents among the beams holding blocks,
        all of one length; the others are new). Each takes its parent's full blocks, shared; the
        first child of a parent takes its partly filled last block, the others a copy of it (copy
        on write): returns the (src, dst) copies for the executor to do before the next step."""
        tpb = self.tokens_per_block
        old = [(list(b.block_table), list(b.block_hashes), b.num_cached_blocks) for b in beams]
        computed = beams[parents[0]].num_computed_tokens
        full, partial = computed // tpb, computed % tpb != 0
        tables, copy_to, taken = [], [], set()
        for i, p in enumerate(parents):
            table = old[p][0]
            keep = table[:full + (partial and p not in taken)]
            if partial and p in taken:
                copy_to.append((i, table[full]))
            taken.add(p)
            self.pool.share(keep)
            tables.append(keep)
        for table, _, _ in old:
            self.pool.release(table)
        # As many partial blocks are freed (parents without a child) as copies need, after the
        # first step (when the new beams come with none): the copies never wait for blocks.
        copies = []
        for i, src in copy_to:
            beam = beams[i]
            if beam.reserved_blocks and not beam.block_table:
                beam.reserved_blocks -= 1
                self.reserved -= 1
            dst = self.pool.allocate(1)[0]
            tables[i].append(dst)
            copies.append((src, dst))
        for beam, p, table in zip(beams, parents, tables):
            beam.block_table = []
            self._append(beam, table)
            beam.block_hashes, beam.num_cached_blocks = list(old[p][1]), min(old[p][2], full)
            beam.num_computed_tokens = computed
        return copies
