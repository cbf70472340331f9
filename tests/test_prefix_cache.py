"""Prefix caching (kiln/runtime/core/block_pool.py, kv_cache_manager.py): requests that share a prompt
prefix compute it once, with greedy outputs identical to caching off; the block pool's invariants
hold after every step of a randomized run with aborts, preemptions and forks; cache salts keep
tenants apart; block hashes cannot be predicted across processes."""
import random
import subprocess
import sys

import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.core.block_pool import NONE, BlockHasher

TPB = 8


def greedy(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, **kw)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def engine_dir(engine):
    return engine("llama", max_input_len=192, max_seq_len=256, max_num_tokens=512)


def chain_hashes(hasher, seq, num_blocks: int) -> list[bytes]:
    """The sequence's block hashes recomputed from scratch."""
    hashes, parent = [], NONE
    for j in range(num_blocks):
        parent = hasher(parent, seq.token_ids[j * TPB:(j + 1) * TPB], seq.request.extra_keys)
        hashes.append(parent)
    return hashes


def record_registrations(kv, seen: dict[bytes, list[int]]) -> None:
    """Every block a sequence adds to the cache: its hash recomputed from the sequence's tokens, and
    those tokens remembered (one hash must always stand for one token chain)."""
    original = kv.cache_full_blocks

    def cache_full_blocks(seq):
        original(seq)
        for j, h in enumerate(chain_hashes(kv.hasher, seq, seq.num_cached_blocks)):
            chain = seq.token_ids[:(j + 1) * TPB]
            assert seen.setdefault(h, chain) == chain
            assert j < seq.num_computed_tokens // TPB  # only blocks whose K/V are computed
    kv.cache_full_blocks = cache_full_blocks


def check_pool(engine, seen: dict[bytes, list[int]]) -> None:
    """The invariants: a block is free exactly when nobody references it; reference counts are the
    references in the live sequences' tables; the tensor block tables mirror the lists; every
    cached hash is one the sequences' tokens gave (recomputed), and a block a sequence holds under
    a hash holds that sequence's tokens."""
    core = engine.core
    kv, pool = core.kv, core.kv.pool
    seqs = [s for r in core.requests.values() for s in r.sequences if not s.finished]
    refs = [0] * pool.num_blocks
    for s in seqs:
        for b in s.block_table:
            refs[b] += 1
        assert kv.block_tables[s.row, :len(s.block_table)].tolist() == s.block_table
    assert refs == pool.ref_counts
    assert all((b in pool.free) == (refs[b] == 0) for b in range(pool.num_blocks))
    assert len(pool.free) == pool.num_free == sum(r == 0 for r in refs)
    for s in seqs:
        for j, h in enumerate(chain_hashes(kv.hasher, s, s.num_cached_blocks)):
            b = s.block_table[j]
            # cached as this block, or (the same tokens twice, as in n > 1 greedy samples) as another
            assert pool.block_hash[b] == h and pool.cached[h] == b or pool.block_hash[b] is None and h in pool.cached
    assert {pool.block_hash[b]: b for b in range(pool.num_blocks) if pool.block_hash[b]} == pool.cached
    assert set(pool.cached) <= set(seen)


def test_randomized_run_keeps_the_pool_consistent(engine_dir):
    rng = random.Random(0)
    system = [rng.randrange(3, 384) for _ in range(40)]
    prompts = []
    for i in range(40):  # shared system prompts of different lengths, or none
        head = system[:rng.choice([0, 8, 17, 40])]
        prompts.append(head + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 30))])
    params = [greedy(rng.randrange(1, 24), n=rng.choice([1, 1, 1, 2, 3])) for _ in prompts]
    # 28 blocks of 8: far fewer than these requests want at once, so that sequences get preempted
    cached = LLM(engine_dir, max_tokens_in_paged_kv_cache=28 * TPB, max_batch_size=6)
    engine, seen = cached.llm_engine, {}
    record_registrations(engine.core.kv, seen)
    finished, pending, aborted = {}, list(range(len(prompts))), set()
    ids = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):  # random arrivals
            if pending:
                i = pending.pop(rng.randrange(len(pending)))
                ids[engine.add_request({"prompt_token_ids": prompts[i]}, params[i])] = i
        if engine.has_unfinished_requests() and rng.random() < 0.05:  # random aborts
            rid = rng.choice(list(engine.output_processor.requests))
            engine.abort(rid)
            aborted.add(ids[rid])
        for out in engine.step():
            if out.finished:
                finished[ids[out.request_id]] = out
        check_pool(engine, seen)
    core = engine.core
    counters = core.scheduler.counters
    assert counters.num_preemptions > 0 and counters.prefix_cache_hits > 0  # the run did preempt and reuse
    assert not core.requests and core.kv.pool.num_free == core.kv.pool.num_blocks
    assert all(c == 0 for c in core.kv.pool.ref_counts) and sorted(core.kv.free_rows) == list(range(6))
    # every request that was not aborted gives what it gives alone, with caching off
    plain = LLM(engine_dir, enable_prefix_caching=False)
    done = sorted(set(finished) - aborted)
    ref = plain.generate([{"prompt_token_ids": prompts[i]} for i in done], [params[i] for i in done])
    assert tokens([finished[i] for i in done]) == tokens(ref)


def test_shared_system_prompt_is_computed_once(engine_dir):
    rng = random.Random(1)
    system = [rng.randrange(3, 384) for _ in range(160)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(3, 384) for _ in range(5 + i)]} for i in range(16)]
    plain = LLM(engine_dir, enable_prefix_caching=False)
    ref = plain.generate(prompts, greedy(12))
    cached = LLM(engine_dir)
    first = cached.generate(prompts[:1], greedy(12))
    computed = []
    schedule = cached.llm_engine.core.scheduler.schedule

    def counting(*args):
        out = schedule(*args)
        computed.extend(n for seq, n in out.scheduled if seq.num_computed_tokens < seq.request.num_prompt_tokens)
        return out

    cached.llm_engine.core.scheduler.schedule = counting
    rest = cached.generate(prompts[1:], greedy(12))
    assert tokens(first + rest) == tokens(ref)
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts[1:])
    assert sum(computed) <= 0.1 * prompt_tokens  # >= 90% fewer prefill tokens computed
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 160 for o in rest)  # 20 full blocks of the system prompt
    stats = cached.llm_engine.core.stats()
    assert stats.prefix_cache_hits == 15 * 160 and stats.prefix_cache_queries == prompt_tokens + 165


def test_cache_salt_keeps_tenants_apart(engine_dir):
    llm = LLM(engine_dir)
    prompt = list(range(3, 60))
    a = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, greedy())[0]
    b = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-b"}, greedy())[0]
    a2 = llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, greedy())[0]
    unsalted = llm.generate({"prompt_token_ids": prompt}, greedy())[0]
    assert (a.num_cached_tokens, b.num_cached_tokens, a2.num_cached_tokens, unsalted.num_cached_tokens) == \
        (0, 0, 56, 0)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == a2.outputs[0].token_ids == unsalted.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": ""}, greedy())


HASH = ("import sys; from kiln.runtime.core.block_pool import BlockHasher, NONE; "
        "seed = None if sys.argv[1] == '-' else int(sys.argv[1]); "
        "print(BlockHasher(seed)(NONE, list(range(8))).hex())")


def test_hashes_are_unpredictable_across_processes_unless_seeded():
    def hashed(seed: str) -> str:
        return subprocess.run([sys.executable, "-c", HASH, seed], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert hashed("-") != hashed("-")
    assert hashed("7") == hashed("7") == BlockHasher(7)(NONE, list(range(8))).hex() != hashed("8")
