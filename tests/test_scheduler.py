"""The scheduler (kiln/runtime/core/scheduler.py) on its own, over a real KV cache manager with small
pools and real requests, each step's results applied as the engine core applies them: the token
budget shared by running sequences (first) and prompts, chunked prefill on and off, batch slots (every
sample of an unforked request, pipeline micro-batches, steps in flight), both policies
(max_utilization preempting the latest admitted and recomputing it; guaranteed_no_evict reserving
at admission and never preempting), blocks kept free for a fork, sliding windows, LongRoPE restarts,
speculative drafts, prefix-cache counters, and LoRA adapter slots (real PEFT adapters read from disk;
the executor that would load them only records set_lora)."""
import itertools
from types import SimpleNamespace

import pytest
import torch

from kiln.convert.hf_config import pretrained_config_from_hf, read_hf_config
from kiln.lora.adapter import Adapter
from kiln.lora.slots import LoraSlots
from kiln.runtime.core.block_pool import OutOfBlocks
from kiln.runtime.core.kv_cache_manager import KVCacheManager
from kiln.runtime.core.request import Request, Sequence, Status
from kiln.runtime.core.scheduler import Scheduler
from kiln.runtime.lora_request import LoRARequest
from kiln.runtime.sampling_params import SamplingParams
from test_lora import save_adapter

TPB = 4
TOKEN = 7  # what every sample draws
_prompts = itertools.count(1)


def scheduler(num_blocks: int = 16, max_batch_size: int = 4, max_num_tokens: int = 16, policy: str = "max_utilization",
              enable_chunked_prefill: bool = True, enable_prefix_caching: bool = False, window: int = 0,
              long_rope_threshold: int = 0, loras=None) -> Scheduler:
    kv = KVCacheManager(num_blocks, TPB, max_batch_size, 16, enable_prefix_caching, prefix_cache_seed=0,
                        window=window, long_rope_threshold=long_rope_threshold)
    return Scheduler(kv, max_batch_size, max_num_tokens, 64, policy, enable_chunked_prefill, loras)


def add(sched: Scheduler, rid: str, prompt: int | list[int], max_tokens: int = 4, n: int = 1,
        lora_request=None) -> Request:
    """A request as the engine core queues it: one sequence; an n = 1 request is forked from the start.
    An int prompt is that many tokens no other prompt shares."""
    if isinstance(prompt, int):
        base = 1000 * next(_prompts)
        prompt = list(range(base, base + prompt))
    req = Request(rid, prompt, SamplingParams(n=n, max_tokens=max_tokens), max_tokens, lora_request=lora_request,
                  extra_keys=() if lora_request is None else (("lora", lora_request.lora_int_id),), forked=n == 1)
    req.sequences.append(Sequence(req, 0, list(prompt)))
    sched.add(req)
    return req


def fork(sched: Scheduler, parent: Sequence) -> list[Sequence]:
    """The prompt is computed: the request's other samples share its blocks (as parallel sampling does)."""
    req = parent.request
    children = [Sequence(req, i, list(parent.token_ids), num_computed_tokens=parent.num_computed_tokens)
                for i in range(1, req.params.n)]
    sched.kv.split_reservation(parent, children)
    for child in children:
        sched.kv.fork(parent, child)
    req.sequences.extend(children)
    sched.add_forked(children)
    req.forked = True
    return children


def advance(sched: Scheduler, out) -> None:
    """A step's results: the scheduled tokens are computed; a sequence with all its tokens computed
    draws one more (an unforked request forks first); one with max_tokens outputs finishes."""
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        sched.kv.cache_full_blocks(seq)
    for seq, _ in out.scheduled:
        if seq.num_computed_tokens < seq.num_tokens:
            continue
        req = seq.request
        for s in [seq] if req.forked else [seq, *fork(sched, seq)]:
            s.token_ids.append(TOKEN)
            if s.num_output_tokens == req.max_tokens:
                sched.finish(s)


def step(sched: Scheduler, **kw) -> list[tuple[str, int, int]]:
    """Schedule and apply one step: (request id, sample index, tokens) of each scheduled sequence."""
    out = sched.schedule(**kw)
    advance(sched, out)
    return [(seq.request.request_id, seq.index, n) for seq, n in out.scheduled]


def run(sched: Scheduler, check=lambda: None, limit: int = 200) -> list[list[tuple[str, int, int]]]:
    """Steps until every request is done, calling check after each; every block is back at the end."""
    steps = []
    while sched.running or sched.waiting:
        steps.append(step(sched))
        check()
        assert len(steps) < limit
    pool = sched.kv.pool
    assert pool.num_free == pool.num_blocks and not any(pool.ref_counts) and sched.kv.reserved == 0
    return steps


def first_step(steps, rid: str) -> int:
    return next(i for i, s in enumerate(steps) if any(r == rid for r, _, _ in s))


def last_step(steps, rid: str) -> int:
    return max(i for i, s in enumerate(steps) if any(r == rid for r, _, _ in s))


# --------------------------------------------------------------------------------- the token budget
def test_running_sequences_first_then_prompts_share_the_budget():
    """Each step's max_num_tokens is spent on running sequences first, in admission order (a decode,
    the rest of a chunked prompt), then on prompts from the queue; a prompt longer than what is left
    is chunked, and a prompt finds nothing when the running ones took it all."""
    sched = scheduler(max_num_tokens=8)
    add(sched, "a", 6)
    add(sched, "b", 10)
    assert step(sched) == [("a", 0, 6), ("b", 0, 2)]
    add(sched, "c", 8)
    assert step(sched) == [("a", 0, 1), ("b", 0, 7)]  # nothing left for c
    assert [s.request.request_id for s in sched.waiting] == ["c"]
    assert step(sched) == [("a", 0, 1), ("b", 0, 1), ("c", 0, 6)]
    assert step(sched) == [("a", 0, 1), ("b", 0, 1), ("c", 0, 2)]
    assert step(sched) == [("b", 0, 1), ("c", 0, 1)]  # a has its 4 tokens
    assert run(sched)[-1] == [("c", 0, 1)]


def test_without_chunked_prefill_a_prompt_waits_for_room_for_all_of_it():
    """enable_chunked_prefill=False: a prompt is admitted only when all of it fits in the step's
    budget; until then it holds no blocks, and the prompts behind it wait too (first come, first served)."""
    sched = scheduler(max_num_tokens=12, enable_chunked_prefill=False)
    add(sched, "a", 6)
    b = add(sched, "b", 10).sequences[0]
    add(sched, "c", 1)
    assert step(sched) == [("a", 0, 6)]  # c would fit; it comes after b
    assert b.status is Status.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.kv.pool.num_free == 16 - 2
    assert step(sched) == [("a", 0, 1), ("b", 0, 10), ("c", 0, 1)]


# --------------------------------------------------------------------------------- batch slots
def test_every_sample_of_an_unforked_request_takes_a_slot():
    """An n = 3 request holds 3 of the batch's slots from admission (its samples fork after the
    prompt); a request that does not fit in the slots left waits, and so do the ones behind it."""
    sched = scheduler(max_batch_size=4)
    add(sched, "a", 4, n=3)
    add(sched, "b", 4, n=2)
    add(sched, "c", 4)
    assert step(sched) == [("a", 0, 4)]
    assert step(sched) == [("a", 0, 1), ("a", 1, 1), ("a", 2, 1)]
    assert [s.request.request_id for s in sched.waiting] == ["b", "c"]
    steps = run(sched)
    assert first_step(steps, "b") == last_step(steps, "a") + 1
    assert steps[first_step(steps, "b")] == [("b", 0, 4), ("c", 0, 4)]


def test_micro_batches_leave_steps_in_flight_alone():
    """max_seqs bounds one step's sequences (a pipeline's micro-batch); sequences of steps in flight
    are neither scheduled nor counted, so the next micro-batch takes others."""
    sched = scheduler(max_batch_size=4)
    a, b, c = (add(sched, r, 4).sequences[0] for r in "abc")
    first = sched.schedule(max_seqs=2)
    assert first.scheduled == [(a, 4), (b, 4)]
    second = sched.schedule(max_seqs=2, in_flight={a, b})
    assert second.scheduled == [(c, 4)]
    advance(sched, first)
    assert sched.schedule(in_flight={c}).scheduled == [(a, 1), (b, 1)]


# --------------------------------------------------------------------------------- policies
def test_max_utilization_preempts_the_latest_admitted_and_recomputes_it():
    """A running sequence that cannot get a block takes one from the latest admitted (itself, if it is
    the latest): that sequence drops its blocks and goes back to the front of the queue with its
    tokens, in arrival order; no prompt is admitted in that step, and it is later computed again,
    prompt and outputs, when it fits."""
    sched = scheduler(num_blocks=3)
    a, b, c = (add(sched, r, 4).sequences[0] for r in "abc")
    assert step(sched) == [("a", 0, 4), ("b", 0, 4), ("c", 0, 4)]
    out = sched.schedule()
    assert out.scheduled == [(a, 1)] and out.preempted == [c, b]
    assert list(sched.waiting) == [b, c] and sched.running == [a]
    for s in (b, c):
        assert s.status is Status.WAITING and s.block_table == [] and s.row == -1 and s.num_computed_tokens == 0
        assert s.token_ids[-1] == TOKEN and s.num_output_tokens == 1
    assert sched.counters.num_preemptions == 2 and len(a.block_table) == 2
    advance(sched, out)
    steps = run(sched)
    assert steps[:2] == [[("a", 0, 1)]] * 2  # b's 5 tokens need 2 blocks: 1 is free until a finishes
    assert steps[2] == [("b", 0, 5)]  # its prompt and its output, recomputed
    assert [s.num_output_tokens for s in (a, b, c)] == [4, 4, 4] and all(s.finished for s in (a, b, c))


def test_guaranteed_no_evict_reserves_at_admission_and_never_preempts():
    """guaranteed_no_evict admits a request only when blocks for all of it (prompt + max_tokens) can
    be reserved, and never preempts; max_utilization admits the same requests at once and preempts
    later. Under no_evict the free pool always covers what is promised."""
    def requests(sched):
        for r in "abc":
            add(sched, r, 6, max_tokens=6)  # 12 tokens: 3 blocks each

    sched = scheduler(num_blocks=6, max_num_tokens=18, policy="guaranteed_no_evict")
    requests(sched)
    assert step(sched) == [("a", 0, 6), ("b", 0, 6)]
    assert sched.kv.reserved == 2 and [s.reserved_blocks for s in sched.running] == [1, 1]
    assert sched.waiting[0].request.request_id == "c" and sched.waiting[0].block_table == []
    steps = run(sched, check=lambda: sched.kv.pool.num_free >= sched.kv.reserved or pytest.fail("over-promised"))
    assert sched.counters.num_preemptions == 0
    assert first_step(steps, "c") == last_step(steps, "a") + 1

    sched = scheduler(num_blocks=6, max_num_tokens=18, policy="max_utilization")
    requests(sched)
    assert step(sched) == [("a", 0, 6), ("b", 0, 6), ("c", 0, 6)]
    run(sched)
    assert sched.counters.num_preemptions > 0


def test_no_evict_reserves_for_every_sample():
    """An n = 2 request reserves the prompt's full blocks once and each sample's own blocks:
    request_blocks(6, 12, 2) = 5 of a 6-block pool, so a second such request waits."""
    sched = scheduler(num_blocks=6, policy="guaranteed_no_evict")
    a = add(sched, "a", 6, max_tokens=6, n=2)
    add(sched, "b", 6, max_tokens=6, n=2)
    assert step(sched) == [("a", 0, 6)]
    # each sample holds 2 blocks and 1 reserved; the child's copy came out of its share
    assert [len(s.block_table) for s in a.sequences] == [2, 2] and [s.reserved_blocks for s in a.sequences] == [1, 1]
    assert sched.kv.reserved == 2 and sched.kv.pool.num_free == 3
    steps = run(sched)
    assert sched.counters.num_preemptions == 0 and first_step(steps, "b") == last_step(steps, "a") + 1


def test_a_fork_keeps_a_block_free_for_its_copy():
    """An n = 2 request whose prompt ends this step will copy its partly filled last block at the
    fork: the step admits no prompt that would take that block."""
    sched = scheduler(num_blocks=3)
    a = add(sched, "a", 5, n=2)
    add(sched, "b", 4)
    assert step(sched) == [("a", 0, 5)]  # then forked: one block copied for sample 1
    assert [s.block_table for s in a.sequences] == [[0, 1], [0, 2]] and sched.kv.pool.num_free == 0
    assert [s.request.request_id for s in sched.waiting] == ["b"]


def test_a_fork_in_flight_keeps_its_block_free():
    """The same with pipeline parallelism: the next micro-batch is scheduled while the step that
    ends the n = 2 prompt is in flight; it must not take the block the fork will copy into."""
    sched = scheduler(num_blocks=3)
    a = add(sched, "a", 5, n=2).sequences[0]
    add(sched, "b", 4)
    first = sched.schedule(max_seqs=1)
    assert first.scheduled == [(a, 5)] and sched.kv.pool.num_free == 1
    second = sched.schedule(max_seqs=1, in_flight={a})
    advance(sched, first)  # the fork: OutOfBlocks if the second step took the block
    assert [s.block_table for s in a.request.sequences] == [[0, 1], [0, 2]] and second.scheduled == []


def test_unknown_policy():
    with pytest.raises(ValueError, match="scheduler policy 'fcfs' is not supported"):
        scheduler(policy="fcfs")


# --------------------------------------------------------------------------------- KV limits
def test_a_sliding_window_bounds_the_blocks_a_sequence_holds():
    """With every layer sliding a window of 8 tokens, two 40-token sequences run side by side in 6
    blocks of 4, holding at most 3 each, without a preemption; without the window 10 blocks are not
    enough for them."""
    def held():
        assert all(sum(b >= 0 for b in s.block_table) <= 3 for s in sched.running)

    sched = scheduler(num_blocks=6, window=8)
    add(sched, "a", 4, max_tokens=36)
    add(sched, "b", 4, max_tokens=36)
    steps = run(sched, check=held)
    assert sched.counters.num_preemptions == 0 and len(steps) == 36
    sched = scheduler(num_blocks=10)
    add(sched, "a", 4, max_tokens=36)
    add(sched, "b", 4, max_tokens=36)
    run(sched)
    assert sched.counters.num_preemptions > 0


def test_long_rope_restart_recomputes_the_sequence():
    """A LongRoPE sequence growing past the threshold is scheduled again from its first token."""
    sched = scheduler(long_rope_threshold=8)
    a = add(sched, "a", 6, max_tokens=6).sequences[0]
    assert [n for s in run(sched) for _, _, n in s] == [6, 1, 1, 9, 1, 1]
    assert a.long_rope and a.finished


# --------------------------------------------------------------------------------- drafts, counters
def test_drafts_go_with_their_sequence_only_if_they_fit():
    """A speculating sequence is its last token and its drafts in one step, if the budget allows;
    otherwise the drafts are dropped and it decodes one token."""
    sched = scheduler(max_num_tokens=4)
    a = add(sched, "a", 4).sequences[0]
    step(sched)
    a.draft_token_ids = [1, 2]
    assert sched.schedule().scheduled == [(a, 3)]
    a.draft_token_ids = [1, 2, 3, 4]
    assert sched.schedule().scheduled == [(a, 1)] and a.draft_token_ids == []


def test_prefix_cache_counters_count_tokens_at_admission():
    """Each admitted sequence adds its tokens to the queries and its cached prefix to the hits; the
    request remembers the prompt tokens found at its first admission."""
    sched = scheduler(enable_prefix_caching=True)
    prompt = list(range(100, 109))
    a = add(sched, "a", prompt)
    run(sched)
    b = add(sched, "b", prompt)
    assert step(sched) == [("b", 0, 1)]
    assert (sched.counters.prefix_cache_queries, sched.counters.prefix_cache_hits) == (18, 8)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)


def test_finish_removes_a_sequence_wherever_it_is():
    """finish (an abort) takes a waiting or running sequence out and gives its blocks back."""
    sched = scheduler(max_num_tokens=4)
    a = add(sched, "a", 8).sequences[0]
    b = add(sched, "b", 4).sequences[0]
    step(sched)
    assert a.num_computed_tokens == 4 and b in sched.waiting
    sched.finish(a)
    sched.finish(b)
    assert a.finished and b.finished and not sched.running and not sched.waiting
    assert sched.kv.pool.num_free == 16 and a.block_table == []


# --------------------------------------------------------------------------------- LoRA slots
class RecordingExecutor:
    """What LoraSlots asks of an executor: the engine's config, and set_lora (recorded here)."""

    def __init__(self, pretrained_config):
        self.config = SimpleNamespace(pretrained_config=pretrained_config)
        self.loaded: list[tuple[int, Adapter]] = []

    def set_lora(self, slot: int, adapter: Adapter) -> None:
        self.loaded.append((slot, adapter))


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory) -> tuple[object, list[LoRARequest]]:
    """The tiny Llama's config and three PEFT adapters of it on disk, as LoRARequests 1, 2, 3."""
    base = hf_model("llama")
    root = tmp_path_factory.mktemp("scheduler_adapters")
    loras = [LoRARequest(name, i, str(save_adapter(base, root / name, 2, 4, ["q_proj", "v_proj"], seed=i)))
             for i, name in enumerate(["one", "two", "three"], 1)]
    return pretrained_config_from_hf(read_hf_config(base)), loras


def lora_scheduler(adapters, max_loras: int, max_cpu_loras: int, **kw) -> tuple[Scheduler, RecordingExecutor]:
    executor = RecordingExecutor(adapters[0])
    return scheduler(loras=LoraSlots(executor, max_loras, max_cpu_loras), **kw), executor


def loaded(executor: RecordingExecutor) -> list[tuple[int, str]]:
    return [(slot, adapter.path.name) for slot, adapter in executor.loaded]


def test_a_sequence_waits_for_a_slot_for_its_adapter(adapters):
    """With one slot: a request whose adapter is not in it waits (holding no blocks), and the ones
    behind it too, until no running sequence holds the slot; the slot is then loaded with its adapter.
    A read adapter is kept in host memory (max_cpu_loras) and not read again."""
    one, two, _ = adapters[1]
    sched, executor = lora_scheduler(adapters, max_loras=1, max_cpu_loras=2)
    a = add(sched, "a", 4, lora_request=one)
    b = add(sched, "b", 4, lora_request=two)
    add(sched, "c", 4, lora_request=one)
    add(sched, "d", 4)
    assert step(sched) == [("a", 0, 4)]
    assert loaded(executor) == [(0, "one")] and a.lora_slot == 0 and b.lora_slot == -1
    assert b.sequences[0].block_table == [] and sched.kv.pool.num_free == 16 - 1
    assert sched.loras.counts() == (1, 1, 1)
    steps = run(sched)
    assert [s for s in steps if s[0][0] != "a"] == [[("b", 0, 4)], [("b", 0, 1)], [("b", 0, 1)], [("b", 0, 1)],
                                                    [("c", 0, 4), ("d", 0, 4)]] + [[("c", 0, 1), ("d", 0, 1)]] * 3
    assert loaded(executor) == [(0, "one"), (0, "two"), (0, "one")]
    assert executor.loaded[2][1] is executor.loaded[0][1]  # from host memory
    assert sched.loras.counts() == (1, 0, 1)


def test_sequences_of_one_adapter_share_its_slot(adapters):
    """Sequences of one adapter, forked samples included, hold its slot together; a preempted one
    gives its hold back, and takes the slot again, its adapter still there, when readmitted."""
    one, two, _ = adapters[1]
    sched, executor = lora_scheduler(adapters, max_loras=2, max_cpu_loras=2, num_blocks=3)
    a = add(sched, "a", 4, lora_request=one, n=2)
    b = add(sched, "b", 4, lora_request=two)
    assert step(sched) == [("a", 0, 4), ("b", 0, 4)]  # a forks: both samples hold slot 0
    assert loaded(executor) == [(0, "one"), (1, "two")] and (a.lora_slot, b.lora_slot) == (0, 1)
    assert sched.loras.users == [2, 1] and sched.loras.counts() == (2, 2, 2)
    out = sched.schedule()  # every sequence needs a second block: 3 blocks for 3 sequences
    assert out.preempted == [a.sequences[1], b.sequences[0]] and sched.loras.users == [1, 0]
    assert sched.loras.counts() == (2, 1, 2)
    advance(sched, out)
    run(sched)
    assert loaded(executor) == [(0, "one"), (1, "two")]  # nothing reloaded
    assert sched.loras.users == [0, 0] and all(s.finished for s in a.sequences + b.sequences)


def test_an_idle_slot_is_reused_least_recently_used_first(adapters):
    """Slots no sequence holds are refilled in the order they fell idle; with max_cpu_loras = 1 an
    adapter evicted from host memory is read from its dir again."""
    one, two, three = adapters[1]
    sched, executor = lora_scheduler(adapters, max_loras=2, max_cpu_loras=1)
    add(sched, "a", 4, max_tokens=1, lora_request=one)
    add(sched, "b", 4, max_tokens=2, lora_request=two)
    assert step(sched) == [("a", 0, 4), ("b", 0, 4)]  # a is done: slot 0 idle
    assert step(sched) == [("b", 0, 1)]  # b is done: slot 1 idle after it
    assert list(sched.loras.idle) == [0, 1]
    add(sched, "c", 4, lora_request=three)
    assert step(sched) == [("c", 0, 4)]
    add(sched, "d", 4, lora_request=one)
    assert step(sched) == [("c", 0, 1), ("d", 0, 4)]
    assert loaded(executor) == [(0, "one"), (1, "two"), (0, "three"), (1, "one")]
    assert sched.loras.slot_of == {3: 0, 1: 1} and list(sched.loras.adapters) == [1]
    first, again = executor.loaded[0][1], executor.loaded[3][1]
    assert again is not first and again.weights.keys() == first.weights.keys()
    assert all(torch.equal(again.weights[k][1], first.weights[k][1]) for k in first.weights)
