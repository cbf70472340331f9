"""LLM.generate on a tiny random Llama (eager engine): the reference outputs (finish reasons, text that
is the tokenizer's decode, token-id prompts), request metrics, seeded sampling that a batch does not
change, n > 1 samples sharing the prompt's full blocks and copying the partly filled one, and
engines dropped in reference cycles being freed although the core freezes the heap."""
import gc
import weakref

import torch

from kiln import LLM, SamplingParams
from runtime_helpers import MAX_TOKENS, assert_all_blocks_free, assert_text_is_decode, greedy, tokens
from runtime_helpers import engine_dir, llm, reference, tok  # noqa: F401 - fixtures
from tiny_models import PROMPTS


def test_reference_outputs(reference, llm, tok):
    """max_tokens ends every greedy ignore_eos request with "length"; text is the tokenizer's decode
    (the tiny model emits bytes that are not valid UTF-8, including at the very end)."""
    for prompt, out in zip(PROMPTS, reference):
        assert out.finished and out.prompt == prompt
        assert out.prompt_token_ids == tok.encode(prompt)
        (c,) = out.outputs
        assert c.index == 0 and c.finish_reason == "length" and c.stop_reason is None
        assert len(c.token_ids) == MAX_TOKENS
    assert_text_is_decode(tok, reference)
    assert any("\ufffd" in o.outputs[0].text for o in reference)  # the detokenizer's hard case is covered
    # prompt_token_ids prompts run the same as text prompts
    again = llm.generate([{"prompt_token_ids": o.prompt_token_ids} for o in reference[:2]], greedy())
    assert tokens(again) == tokens(reference[:2])
    assert again[0].prompt is None
    assert_all_blocks_free(llm.llm_engine)


def test_metrics(reference):
    for out in reference:
        m = out.metrics
        assert m.num_output_tokens == MAX_TOKENS
        assert m.time_to_first_token is not None and m.time_to_first_token > 0
        assert m.time_per_output_token is not None and m.time_per_output_token > 0
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_seeded_sampling(llm, reference):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], seeded)[0].outputs[0].token_ids
    again = llm.generate(PROMPTS[1], seeded)[0].outputs[0].token_ids
    assert alone == again
    # the same seed in a batch with unseeded and other seeded requests, in another position;
    # top_k=1 at temperature 1 is greedy
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[4], PROMPTS[2]], [
        SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=10, ignore_eos=True),
        seeded,
        SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True, seed=5)])
    assert batch[2].outputs[0].token_ids == alone
    assert batch[1].outputs[0].token_ids != alone  # another seed, another sample
    assert batch[3].outputs[0].token_ids == reference[4].outputs[0].token_ids
    assert batch[4].outputs[0].token_ids == reference[2].outputs[0].token_ids
    assert_all_blocks_free(llm.llm_engine)


def test_n_greedy_equals_n1(llm, reference, tok):
    outs = llm.generate([PROMPTS[0], PROMPTS[2]], greedy(n=3))  # a short and the longest prompt
    for out, ref in zip(outs, [reference[0], reference[2]], strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == [ref.outputs[0].token_ids] * 3
        assert all(c.finish_reason == "length" for c in out.outputs)
    assert_text_is_decode(tok, outs)
    assert_all_blocks_free(llm.llm_engine)


def test_n_samples_share_prompt_blocks(llm, tok):
    engine = llm.llm_engine
    pool, tpb = engine.core.kv.pool, engine.build_config.tokens_per_block
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    req = engine.core.requests[engine.add_request(PROMPTS[1], params)]
    P = req.num_prompt_tokens
    assert P > tpb and P % tpb  # full blocks to share and a partly filled one to copy
    engine.step()  # the whole prompt, the fork, the first token of each sample
    seqs = req.sequences
    assert [s.index for s in seqs] == [0, 1, 2, 3]
    full = P // tpb
    tables = [s.block_table for s in seqs]
    assert all(t[:full] == tables[0][:full] for t in tables)  # the prompt's full blocks are shared
    assert all(pool.ref_counts[b] == 4 for b in tables[0][:full])
    lasts = [t[full] for t in tables]
    assert len(set(lasts)) == 4  # the partly filled block is copied, one each
    kv = engine.core.executor.engine.kv_cache
    for b in lasts[1:]:
        assert torch.equal(kv[:, :, b, :P % tpb], kv[:, :, lasts[0], :P % tpb])
    used = pool.num_blocks - pool.num_free
    assert used == full + 4 < 4 * engine.core.kv.blocks_for(P + 1)
    while engine.has_unfinished_requests():
        outs = engine.step()
    (out,) = outs
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # sampled, not copies
    assert_text_is_decode(tok, [out])
    assert_all_blocks_free(engine)
    # the same seed gives the same n samples
    again = llm.generate(PROMPTS[1], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_frozen_heap_frees_dropped_engines(engine_dir):
    """The engine core freezes the heap out of the garbage collector (KILN_GC_FREEZE): an engine
    dropped in a reference cycle is still freed, at the next engine's start or at shutdown."""
    dropped = LLM(engine_dir)
    dropped.cycle = dropped
    ref = weakref.ref(dropped)
    del dropped
    assert gc.get_freeze_count() > 0 and ref() is not None
    LLM(engine_dir).generate(["x"], greedy(2))
    assert ref() is None
    closed = LLM(engine_dir)
    closed.cycle = closed
    ref = weakref.ref(closed)
    closed.llm_engine.shutdown()
    del closed
    gc.collect()
    assert ref() is None
