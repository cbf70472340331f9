"""In-flight batching end to end on a tiny random Llama (eager engines) with a small token budget or
a small KV cache: chunked prefill (chunks beside other sequences' decodes), preemption and recompute
under max_utilization, waiting under guaranteed_no_evict, n > 1 forks under preemption, aborts mid
prefill and mid decode; every configuration gives the reference's tokens and every block back."""
import math

import pytest

from conftest import TEST_BUILD
from kiln import LLM, SamplingParams
from kiln.runtime.frontend.tokenizer import load_tokenizer
from runtime_helpers import (MAX_TOKENS, PLP, assert_all_blocks_free, assert_text_is_decode, close_logprobs, greedy,
                             ref_params, tokens)
from runtime_helpers import chunked_llm, engine_dir, llm, reference, tok  # noqa: F401 - fixtures
from tiny_models import PROMPTS

TPB = TEST_BUILD["tokens_per_block"]
# Prompt lengths depend on the tokenizer, trained on the installed Python's json package
# (tests/tiny_models.py): sizes built on them are derived here, never pasted.
PREEMPTED = [0, 1, 4]  # short prompts with long outputs (test_preemption_same_tokens)
PREEMPT_OUTPUT = 24


def blocks(num_tokens: int) -> int:
    return -(-num_tokens // TPB)


# --------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def prompt_lens(engine_dir) -> list[int]:
    tok = load_tokenizer(engine_dir)
    return [len(tok.encode(p)) for p in PROMPTS]


@pytest.fixture(scope="module")
def preempt_blocks(prompt_lens) -> int:
    """Each of the PREEMPTED prompts with its long output fits in the cache; not all at once."""
    need = [blocks(prompt_lens[i] + PREEMPT_OUTPUT) for i in PREEMPTED]
    assert sum(need) > max(need)
    return max(need)


@pytest.fixture(scope="module")
def no_evict_blocks(prompt_lens) -> int:
    """Room for the longest prompt's whole sequence and one block more: far from all prompts at once."""
    return max(blocks(n + MAX_TOKENS) for n in prompt_lens) + 1


@pytest.fixture(scope="module")
def preempting_llm(engine_dir, preempt_blocks):
    return LLM(engine_dir, scheduler_policy="max_utilization", max_tokens_in_paged_kv_cache=preempt_blocks * TPB,
               enable_prefix_caching=False)  # block counts as the tests work them out


@pytest.fixture(scope="module")
def no_evict_llm(engine_dir, no_evict_blocks):
    return LLM(engine_dir, scheduler_policy="guaranteed_no_evict",
               max_tokens_in_paged_kv_cache=no_evict_blocks * TPB, enable_prefix_caching=False)


# --------------------------------------------------------------------------------- chunked prefill
def test_chunked_prefill_same_tokens(chunked_llm, reference, monkeypatch):
    engine = chunked_llm.llm_engine
    steps = []
    schedule = engine.core.scheduler.schedule

    def recording_schedule(*args):
        out = schedule(*args)
        steps.append([(seq.request.request_id, seq.num_computed_tokens, n, seq.request.num_prompt_tokens)
                      for seq, n in out.scheduled])
        return out

    monkeypatch.setattr(engine.core.scheduler, "schedule", recording_schedule)
    outs = chunked_llm.generate(PROMPTS, ref_params())
    assert tokens(outs) == tokens(reference)
    for a, b in zip(outs, reference):
        assert a.outputs[0].text == b.outputs[0].text
    # prompt logprobs, computed chunk by chunk, are the same too
    for a, b in zip(outs[PLP].prompt_logprobs[1:], reference[PLP].prompt_logprobs[1:], strict=True):
        close_logprobs(a, b, 1e-5)
    assert outs[PLP].prompt_logprobs[0] is None

    # the prompts really were chunked: no step over 16 tokens, the longest prompt took several steps,
    # and prefill chunks shared steps with other sequences' decodes
    assert all(sum(n for *_, n, _ in s) <= 16 for s in steps)
    longest = max(outs, key=lambda o: len(o.prompt_token_ids))
    length = len(longest.prompt_token_ids)
    chunks = [n for s in steps for rid, done, n, p in s if rid == longest.request_id and done < p]
    assert length > 2 * 16 and len(chunks) >= math.ceil(length / 16) and sum(chunks) == length
    assert any(any(done >= p for _, done, _, p in s) and any(done + n < p for _, done, n, p in s) for s in steps)
    assert_all_blocks_free(engine)


# --------------------------------------------------------------------------------- preemption
def test_preemption_same_tokens(preempting_llm, llm, tok, preempt_blocks):
    engine = preempting_llm.llm_engine
    assert engine.core.kv.pool.num_blocks == preempt_blocks
    prompts = [PROMPTS[i] for i in PREEMPTED]
    params = [greedy(PREEMPT_OUTPUT), greedy(PREEMPT_OUTPUT, prompt_logprobs=1), greedy(PREEMPT_OUTPUT)]
    before = engine.core.scheduler.counters.num_preemptions
    outs = preempting_llm.generate(prompts, params)
    assert engine.core.scheduler.counters.num_preemptions > before
    roomy = llm.generate(prompts, params)
    assert tokens(outs) == tokens(roomy)
    assert all(len(t) == PREEMPT_OUTPUT for t in tokens(outs))
    assert_text_is_decode(tok, outs)
    # prompt logprobs of a request that may have been preempted are neither lost nor scored twice
    assert outs[1].prompt_logprobs[0] is None
    for a, b in zip(outs[1].prompt_logprobs[1:], roomy[1].prompt_logprobs[1:], strict=True):
        close_logprobs(a, b, 1e-5)
    assert_all_blocks_free(engine)


def test_guaranteed_no_evict_same_tokens(no_evict_llm, reference, prompt_lens, no_evict_blocks):
    engine = no_evict_llm.llm_engine
    which = [0, 1, PLP, 4]
    # the first two, then prompt PLP, cannot all hold their whole sequences at once
    assert sum(blocks(prompt_lens[i] + MAX_TOKENS) for i in which[:3]) > no_evict_blocks
    outs = no_evict_llm.generate([PROMPTS[i] for i in which], [ref_params()[i] for i in which])
    assert tokens(outs) == [reference[i].outputs[0].token_ids for i in which]
    for a, b in zip(outs[2].prompt_logprobs[1:], reference[PLP].prompt_logprobs[1:], strict=True):
        close_logprobs(a, b, 1e-5)
    assert engine.core.scheduler.counters.num_preemptions == 0
    # the cache really was too small: the long request waited until the first ones finished
    assert outs[2].metrics.first_scheduled_time > outs[0].metrics.finished_time
    assert_all_blocks_free(engine)


def test_preemption_with_n_and_seeds(preempting_llm, llm, reference):
    """n > 1 requests under preemption: siblings forked from shared blocks get preempted and
    recomputed; seeded samples come out as they do with a roomy cache."""
    params = [SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=8, ignore_eos=True),
              greedy(8, n=3), SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=8, ignore_eos=True)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
    engine = preempting_llm.llm_engine
    before = engine.core.scheduler.counters.num_preemptions
    small = preempting_llm.generate(prompts, params)
    assert engine.core.scheduler.counters.num_preemptions > before
    roomy = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in small] == [[c.token_ids for c in o.outputs] for o in roomy]
    assert [c.token_ids for c in small[1].outputs] == [reference[1].outputs[0].token_ids[:8]] * 3
    assert_all_blocks_free(engine)
    assert_all_blocks_free(llm.llm_engine)


def test_fork_blocks_are_kept_free_within_a_step(preempting_llm):
    """Regression: an n=2 request finishing its prompt, then a prompt admitted in the same step that
    would take every block left; the fork's copy of the partly filled last block must still find
    a free block (was OutOfBlocks in the middle of a step)."""
    rest = preempting_llm.llm_engine.core.kv.pool.num_blocks - 1
    outs = preempting_llm.generate([{"prompt_token_ids": [5] * 5}, {"prompt_token_ids": [6] * (rest * TPB)}],
                                   [greedy(8, n=2), greedy(8)])  # 1 block, then every other one
    assert [len(o.outputs) for o in outs] == [2, 1]
    assert outs[0].outputs[0].token_ids == outs[0].outputs[1].token_ids
    assert_all_blocks_free(preempting_llm.llm_engine)


def test_abort_frees_blocks(chunked_llm, no_evict_llm):
    # mid chunked prefill, and mid decode after a fork
    engine = chunked_llm.llm_engine
    long = engine.core.requests[engine.add_request(PROMPTS[2], greedy())]
    forked = engine.core.requests[engine.add_request(PROMPTS[1], greedy(n=3))]
    engine.step()
    assert 0 < long.sequences[0].num_computed_tokens < long.num_prompt_tokens
    aborted = engine.abort(long.request_id)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    while len(forked.sequences) < 3 or not forked.sequences[0].output_token_ids:
        engine.step()
    engine.step()
    out = engine.abort(forked.request_id)
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert all(len(c.token_ids) >= 1 for c in out.outputs)
    assert engine.abort(forked.request_id) is None  # already gone
    assert_all_blocks_free(engine)
    # guaranteed_no_evict: the running request's reservation is returned along with its blocks
    engine = no_evict_llm.llm_engine
    running = engine.core.requests[engine.add_request(PROMPTS[2], greedy())]
    waiting = engine.core.requests[engine.add_request(PROMPTS[3], greedy(n=2))]
    engine.step()
    engine.step()
    assert engine.core.kv.reserved > 0 and running.sequences[0].output_token_ids
    assert waiting.sequences[0].num_computed_tokens == 0  # no room for both
    engine.abort(waiting.request_id)
    engine.abort(running.request_id)
    assert_all_blocks_free(engine)


