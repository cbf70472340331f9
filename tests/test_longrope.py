"""LongRoPE (Phi-3.5, Phi-4-mini): a sequence up to original_max_position_embeddings long rotates q and k
with the short factors, a longer one with the long factors, and one that grows past the switch while
generating is recomputed with the long ones, as HF recomputes it. Parity from the published configs, both
transformers majors and aoti: tests/test_hf_parity.py (phi3.5, phi4-mini)."""
import pytest
import torch

from published_models import recomputing_greedy

SWITCH = 24  # tests/tiny_models.py's phi3_longrope
NEW_TOKENS = 24


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_batches_mixing_short_long_and_switching_sequences_match_hf(policy, engine, hf_model):
    import transformers

    from kiln import LLM, SamplingParams

    model_dir = hf_model("phi3_longrope")
    g = torch.Generator().manual_seed(1)
    long = torch.randint(3, 384, (30,), generator=g).tolist()
    # Long from the start; its first 20 tokens (short, then past the switch: recomputed, finding the long
    # prompt's blocks in the prefix cache, never the short ones); short throughout; switching at 25.
    prompts = [long, long[:20], torch.randint(3, 384, (2,), generator=g).tolist(),
               torch.randint(3, 384, (10,), generator=g).tolist()]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = [recomputing_greedy(model, p, NEW_TOKENS)[0] for p in prompts]

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # 10 blocks of 8 tokens for 4 sequences of up to 54: preempted and recomputed on the way, or (reserving
    # blocks for the recomputation too) admitted as they fit
    llm = LLM(engine("phi3_longrope"), max_tokens_in_paged_kv_cache=80, scheduler_policy=policy)
    try:
        core = llm.llm_engine.core
        assert core.kv.long_rope_threshold == SWITCH
        for _ in range(2):  # the second time from the prefix cache
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert [o.outputs[0].token_ids for o in outs] == want
        assert (core.scheduler.counters.num_preemptions > 0) == (policy == "max_utilization")
        assert core.kv.pool.num_free == core.kv.pool.num_blocks
    finally:
        llm.llm_engine.shutdown()
