"""The KV cache manager and its block pool (kiln/runtime/core/kv_cache_manager.py, block_pool.py) on
their own, with small pools and real requests: which blocks a sequence gets and in which order they
come back, its row of the tensor block tables, reservations, prefix-cache hits (whole, partial,
salted, never the block of the last token, none for a request owed prompt logprobs), eviction order,
sliding-window release, LongRoPE restarts, and forks that copy a partly filled last block."""
import itertools

import pytest

from kiln.runtime.core.block_pool import NONE, BlockHasher, OutOfBlocks
from kiln.runtime.core.kv_cache_manager import KVCacheManager
from kiln.runtime.core.request import Request, Sequence
from kiln.runtime.sampling_params import SamplingParams

TPB = 4
_prompts = itertools.count(1)


def manager(num_blocks: int = 8, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, TPB, max_seqs=4, max_blocks_per_seq=16, prefix_cache_seed=0, **kw)


def prompt(length: int) -> list[int]:
    """Tokens no other prompt of this file shares: no prefix-cache hit unless a test makes one."""
    base = 1000 * next(_prompts)
    return list(range(base, base + length))


def sequence(tokens: list[int], max_tokens: int = 8, extra_keys: tuple = (), **params) -> Sequence:
    """The first sequence of a request, as the engine core makes it."""
    req = Request("r", tokens, SamplingParams(max_tokens=max_tokens, **params), max_tokens, extra_keys=extra_keys,
                  forked=params.get("n", 1) == 1)
    req.sequences.append(Sequence(req, 0, list(tokens)))
    return req.sequences[0]


def compute(kv: KVCacheManager, seq: Sequence, n: int) -> None:
    """What a step does for a sequence: room for n more tokens, their K/V computed, full blocks cached."""
    assert kv.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    kv.cache_full_blocks(seq)


def row(kv: KVCacheManager, seq: Sequence) -> list[int]:
    return kv.block_tables[seq.row, :len(seq.block_table)].tolist()


# --------------------------------------------------------------------------------- allocation
def test_blocks_come_from_the_cold_end_and_go_back_in_table_order():
    """Blocks are taken lowest first from a fresh pool, one reference each, recorded in the
    sequence's row of block_tables; freeing returns them (uncached: to the cold end, in table order),
    its row and nothing else."""
    kv = manager(8)
    a, b = sequence(prompt(6)), sequence(prompt(3))
    assert kv.allocate_slots(a, 6) and a.block_table == [0, 1] and a.row == 0 and row(kv, a) == [0, 1]
    assert kv.allocate_slots(b, 3) and b.block_table == [2] and b.row == 1 and row(kv, b) == [2]
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 2) and a.block_table == [0, 1]  # 8 tokens: still two blocks
    assert kv.allocate_slots(a, 3) and a.block_table == [0, 1, 3] and row(kv, a) == [0, 1, 3]
    assert kv.pool.ref_counts == [1, 1, 1, 1, 0, 0, 0, 0] and kv.pool.num_free == 4
    kv.free(a)
    assert a.block_table == [] and a.row == -1 and a.num_cached_blocks == 0
    assert list(kv.pool.free) == [0, 1, 3, 4, 5, 6, 7] and kv.pool.ref_counts[2] == 1
    c = sequence(prompt(1))
    assert kv.allocate_slots(c, 1) and c.block_table == [0] and c.row == 0  # a's row, reused


def test_a_short_pool_takes_nothing():
    """allocate_slots answers False and takes nothing when the blocks (plus the headroom kept free
    beside them) are not there; OutOfBlocks from the pool itself."""
    kv = manager(4)
    a, b = sequence(prompt(8)), sequence(prompt(12))
    assert kv.allocate_slots(a, 8) and kv.pool.num_free == 2
    assert not kv.allocate_slots(b, 12) and b.block_table == [] and b.row == -1 and kv.pool.num_free == 2
    assert not kv.allocate_slots(b, 8, headroom=1) and kv.pool.num_free == 2
    assert kv.allocate_slots(b, 4, headroom=1) and b.block_table == [2] and kv.pool.num_free == 1
    with pytest.raises(OutOfBlocks, match="need 2 blocks, 1 free"):
        kv.pool.allocate(2)


def test_reservations_are_spent_before_the_free_pool():
    """guaranteed_no_evict's reservation: reserved blocks are not available to others, a sequence's
    allocations come out of its own reservation first, and free returns what is left of it."""
    kv = manager(6)
    a, b = sequence(prompt(5)), sequence(prompt(4))
    assert kv.reserve(a, 4) and kv.reserved == 4 and kv.num_available == 2
    assert not kv.reserve(b, 3) and b.reserved_blocks == 0 and kv.reserved == 4
    assert kv.allocate_slots(a, 5) and a.reserved_blocks == 2 and kv.reserved == 2 and kv.num_available == 2
    assert not kv.allocate_slots(b, 4, headroom=2)  # the free blocks left are promised to a
    assert kv.allocate_slots(b, 4) and kv.num_available == 1
    kv.free(a)
    assert kv.reserved == 0 and a.reserved_blocks == 0 and kv.num_available == 5


# --------------------------------------------------------------------------------- prefix cache
def test_prefix_hits_whole_and_partial():
    """A sequence holding no blocks takes the cached blocks of its longest cached prefix (full blocks
    only, never the one holding its last token); the tokens they hold count as computed."""
    kv = manager(8)
    tokens = prompt(12)
    a = sequence(tokens)
    compute(kv, a, 12)
    assert a.num_cached_blocks == 3 and a.block_table == [0, 1, 2]
    kv.free(a)
    same = sequence(tokens)
    assert kv.take_cached(same) == 8  # block 2 holds the last token, whose logits are owed
    assert same.block_table == [0, 1] and same.num_computed_tokens == 8 and same.num_cached_blocks == 2
    assert row(kv, same) == [0, 1] and kv.pool.ref_counts[:3] == [1, 1, 0] and 0 not in kv.pool.free
    longer = sequence(tokens + [7])
    assert kv.take_cached(longer) == 12 and longer.block_table == [0, 1, 2]
    assert kv.pool.ref_counts[:3] == [2, 2, 1]  # shared with `same`, which still holds 0 and 1
    partial = sequence(tokens[:6] + [7] * 6)
    assert kv.take_cached(partial) == 4 and partial.block_table == [0]
    assert kv.take_cached(sequence(prompt(12))) == 0


def test_extra_keys_and_seeds_change_hashes():
    """A cache salt (or LoRA id) is in every block hash: only the same keys hit. Hashes are keyed:
    another seed gives other hashes for the same tokens."""
    kv = manager(8)
    tokens = prompt(9)
    compute(kv, salted := sequence(tokens, extra_keys=("tenant-a",)), 9)
    kv.free(salted)
    assert kv.take_cached(sequence(tokens)) == 0
    assert kv.take_cached(sequence(tokens, extra_keys=("tenant-b",))) == 0
    assert kv.take_cached(sequence(tokens, extra_keys=(("lora", 1),))) == 0
    assert kv.take_cached(sequence(tokens, extra_keys=("tenant-a",))) == 8
    block = tokens[:TPB]
    assert BlockHasher(0)(NONE, block) == BlockHasher(0)(NONE, block) != BlockHasher(1)(NONE, block)
    assert BlockHasher(0)(NONE, block) != BlockHasher(0)(NONE, block, ("tenant-a",))


def test_prompt_logprobs_take_no_cached_blocks():
    """A request owed prompt logprobs needs the logits of every prompt position: nothing cached serves it."""
    kv = manager(8)
    tokens = prompt(9)
    compute(kv, a := sequence(tokens), 9)
    kv.free(a)
    owed = sequence(tokens, prompt_logprobs=1)
    assert owed.request.cacheable_tokens == 0
    assert kv.take_cached(owed) == 0 and owed.block_table == [] and owed.num_computed_tokens == 0
    assert kv.take_cached(sequence(tokens)) == 8


def test_caching_off_never_hits():
    """enable_prefix_caching=False: no block is cached, no sequence takes one."""
    kv = manager(8, enable_prefix_caching=False)
    tokens = prompt(9)
    compute(kv, a := sequence(tokens), 9)
    assert a.num_cached_blocks == 0 and not kv.pool.cached
    kv.free(a)
    assert kv.take_cached(sequence(tokens)) == 0


def test_one_hash_one_block():
    """Two sequences computing the same tokens side by side: the first to fill a block caches it,
    the second's copy stays uncached and goes back to the cold end when freed."""
    kv = manager(8)
    tokens = prompt(5)
    a, b = sequence(tokens), sequence(tokens)
    compute(kv, a, 5)
    compute(kv, b, 5)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    assert kv.pool.block_hash[0] is not None and kv.pool.block_hash[2] is None and len(kv.pool.cached) == 1
    kv.free(b)
    kv.free(a)
    assert list(kv.pool.free)[:2] == [1, 2] and list(kv.pool.free)[-1] == 0  # cached block 0 hottest


def test_cached_blocks_are_evicted_last_and_tails_first():
    """Freed cached blocks wait at the hot end, a sequence's tail before its head, so that uncached
    blocks are reused first and a prefix loses its last block before its first; a reused block
    leaves the cache."""
    kv = manager(4)
    tokens = prompt(9)
    compute(kv, a := sequence(tokens), 9)  # blocks 0, 1 cached; block 2 holds the ninth token
    kv.free(a)
    assert list(kv.pool.free) == [2, 3, 1, 0]
    b = sequence(prompt(8))
    assert kv.allocate_slots(b, 8) and b.block_table == [2, 3]
    hit = sequence(tokens)
    assert kv.take_cached(hit) == 8 and hit.block_table == [0, 1]  # both still cached
    kv.free(hit)
    kv.free(b)  # nothing cached in b: its blocks go first again
    assert list(kv.pool.free) == [2, 3, 1, 0]
    c = sequence(prompt(12))
    assert kv.allocate_slots(c, 12) and c.block_table == [2, 3, 1]
    assert kv.pool.block_hash[1] is None and len(kv.pool.cached) == 1
    assert kv.take_cached(sequence(tokens)) == 4  # the head of the prefix is left


# --------------------------------------------------------------------------------- sliding window
def test_blocks_behind_the_window_go_back():
    """With every layer sliding a window of 8, a block wholly before the window of the sequence's
    next query is released (its entry -1), still findable by its hash; a sequence holds at most
    three blocks of 4 however long it grows."""
    kv = manager(16, window=8)
    tokens = prompt(41)
    seq = sequence(tokens[:4], max_tokens=37)
    compute(kv, seq, 4)
    held = []
    for t in tokens[4:40]:
        seq.token_ids.append(t)
        compute(kv, seq, 1)
        held.append(sum(b >= 0 for b in seq.block_table))
    assert max(held) == 3 and len(seq.block_table) == 10
    # the next query, at position 40, sees 33..40: blocks 0..7 (positions 0..31) are gone
    seq.token_ids.append(tokens[40])
    assert kv.allocate_slots(seq, 1) and len(seq.block_table) == 11
    assert seq.block_table[:8] == [-1] * 8 and seq.block_table[8:] == [8, 9, 10]
    assert kv.block_tables[seq.row, :11].tolist() == seq.block_table  # the engine's table row in step
    assert kv.pool.num_free == 16 - 3 and [b for b in range(16) if kv.pool.ref_counts[b]] == [8, 9, 10]
    again = sequence(tokens[:9])
    assert kv.take_cached(again) == 8 and again.block_table == [0, 1]  # released, not yet reused
    kv.free(seq)
    kv.free(again)
    assert kv.pool.num_free == 16 and not any(kv.pool.ref_counts)


def test_the_window_keeps_what_the_query_sees():
    """A block overlapping the window of the next query (position num_computed_tokens) stays."""
    kv = manager(8, window=8)
    seq = sequence(prompt(12))
    compute(kv, seq, 10)  # the next query at 10 sees 3..10: block 0 still needed
    assert kv.allocate_slots(seq, 2) and seq.block_table == [0, 1, 2]
    seq.num_computed_tokens = 11  # the query at 11 sees 4..11
    assert kv.allocate_slots(seq, 1) and seq.block_table == [-1, 1, 2] and kv.pool.ref_counts[0] == 0


# --------------------------------------------------------------------------------- LongRoPE
def test_long_rope_restart():
    """A sequence computed with LongRoPE's short factors gives back its blocks and starts again once
    it grows past the threshold; its blocks stay cached under short-factor hashes, which a long
    sequence never takes, and a short one still does."""
    kv = manager(8, long_rope_threshold=8)
    tokens = prompt(9)
    seq = sequence(tokens[:8])
    assert kv.take_cached(seq) == 0 and not seq.long_rope
    compute(kv, seq, 8)
    assert not kv.restart_with_long_rope(seq)  # 8 tokens: not past the threshold
    seq.token_ids.append(tokens[8])
    assert kv.restart_with_long_rope(seq)
    assert seq.long_rope and seq.block_table == [] and seq.num_computed_tokens == 0
    assert kv.pool.num_free == 8 and len(kv.pool.cached) == 2
    assert not kv.restart_with_long_rope(seq)
    assert kv.take_cached(sequence(tokens[:8] + [1])) == 0  # past the threshold: long-factor hashes
    assert kv.take_cached(sequence(tokens[:8])) == 4
    # what a long-rope request holds at most: the long recompute beside the short blocks it may share
    assert kv.request_blocks(6, 12, 1) == (3 + 3, 6 - 1)


# --------------------------------------------------------------------------------- forks
def n_request(tokens: list[int], n: int, max_tokens: int = 6) -> Sequence:
    return sequence(tokens, max_tokens=max_tokens, n=n, temperature=1.0)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    """n > 1 samples fork from the computed prompt: the full blocks are shared (one reference per
    sample), the partly filled last block is copied into a new block for each child, and the copy
    (source, destination) is returned for the executor."""
    kv = manager(8)
    parent = n_request(prompt(6), 3)
    compute(kv, parent, 6)
    children = [Sequence(parent.request, i, list(parent.token_ids), num_computed_tokens=6) for i in (1, 2)]
    assert [kv.fork(parent, c) for c in children] == [(1, 2), (1, 3)]
    assert [s.block_table for s in [parent, *children]] == [[0, 1], [0, 2], [0, 3]]
    assert [row(kv, c) for c in children] == [[0, 2], [0, 3]] and len({s.row for s in [parent, *children]}) == 3
    assert kv.pool.ref_counts[:4] == [3, 1, 1, 1]
    assert all(c.num_cached_blocks == 1 and c.block_hashes == parent.block_hashes for c in children)
    for s in [parent, *children]:
        kv.free(s)
    assert kv.pool.num_free == 8 and not any(kv.pool.ref_counts)


def test_fork_of_full_blocks_copies_nothing():
    """A prompt that fills its blocks: the child shares them all, and there is nothing to copy."""
    kv = manager(8)
    parent = n_request(prompt(8), 2)
    compute(kv, parent, 8)
    child = Sequence(parent.request, 1, list(parent.token_ids), num_computed_tokens=8)
    assert kv.fork(parent, child) is None
    assert child.block_table == parent.block_table == [0, 1] and kv.pool.ref_counts[:2] == [2, 2]


def test_split_reservation_covers_every_sample():
    """guaranteed_no_evict with n = 2: the request's reservation (prompt blocks once, each sample's
    own blocks) is split at the fork, the child's copy comes out of its share, and both samples grow
    to max_len with every block taken from the reservation."""
    kv = manager(8)
    parent = n_request(prompt(6), 2, max_tokens=6)  # 12 tokens a sample: 3 blocks, 2 of them its own
    total, own = kv.request_blocks(6, 12, 2)
    assert (total, own) == (5, 2)
    assert kv.reserve(parent, total) and kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    assert parent.reserved_blocks == 3 and kv.reserved == 3
    child = Sequence(parent.request, 1, list(parent.token_ids), num_computed_tokens=6)
    kv.split_reservation(parent, [child])
    assert (parent.reserved_blocks, child.reserved_blocks) == (1, 2)
    assert kv.fork(parent, child) == (1, 2)
    assert child.reserved_blocks == 1 and kv.reserved == 2 and kv.num_available == 8 - 3 - 2
    for s in (parent, child):
        assert kv.allocate_slots(s, 6)  # to 12 tokens
    assert kv.reserved == 0 and parent.reserved_blocks == child.reserved_blocks == 0
    assert kv.pool.num_free == 8 - total
