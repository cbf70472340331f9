"""What the Triton backend needs from the runtime beyond vLLM's API (TensorRT-LLM's request options):
context and generation logits against HF transformers (chunked prefill and preemption included),
bad words, and the iteration stats behind the in-flight batching metrics."""
import pytest
import torch

from kiln import LLM, AsyncLLM, SamplingParams
from kiln.runtime.frontend.llm_engine import LLMEngine
from tiny_models import PROMPTS


@pytest.fixture(scope="module")
def engine_dir(engine):
    return engine("llama")


@pytest.fixture(scope="module")
def hf(hf_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_model("llama"), dtype=torch.float32).eval()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("engine_args", [{}, {"max_num_tokens": 16}, {"max_tokens_in_paged_kv_cache": 128}],
                         ids=["one_chunk", "chunked_prefill", "preempted"])
def test_context_and_generation_logits_match_hf(engine_dir, hf, engine_args):
    llm = LLM(engine_dir, threads=1, **engine_args)
    logits = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1,
                            return_context_logits=True, return_generation_logits=True)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # A long generation beside them fills the small KV cache (16 blocks) and preempts the others.
    outs = llm.generate([PROMPTS[1], PROMPTS[3], PROMPTS[0]], [plain, logits, logits])
    for out in outs[1:]:
        prompt, generated = out.prompt_token_ids, out.outputs[0].token_ids
        ref = hf_logits(hf, prompt + generated)
        assert out.context_logits.shape == (len(prompt), ref.shape[1])
        torch.testing.assert_close(out.context_logits, ref[:len(prompt)], atol=1e-4, rtol=1e-4)
        gen = torch.stack(out.outputs[0].generation_logits)
        assert gen.shape == (len(generated), ref.shape[1])
        torch.testing.assert_close(gen, ref[len(prompt) - 1:-1], atol=1e-4, rtol=1e-4)
        assert len(out.prompt_logprobs) == len(prompt)  # prompt logprobs still come out alongside
    if "max_tokens_in_paged_kv_cache" in engine_args:
        assert llm.llm_engine.core.scheduler.counters.num_preemptions > 0
    assert outs[0].context_logits is None and outs[0].outputs[0].generation_logits is None


def test_logits_cross_the_core_process(engine_dir):
    """Tensors in a step's outputs reach a frontend whose core is another process (a Triton model's
    case): by value, not as file descriptors that need the sender's multiprocessing key."""
    import asyncio

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, return_context_logits=True,
                            return_generation_logits=True)
    ref = LLM(engine_dir, threads=1).generate(PROMPTS[2], params)[0]

    async def run():
        a = AsyncLLM(engine_dir, threads=1)
        try:
            async for out in a.generate(PROMPTS[2], params, request_id="logits"):
                pass
            return out
        finally:
            a.shutdown()

    out = asyncio.run(run())
    torch.testing.assert_close(out.context_logits, ref.context_logits, atol=0, rtol=0)
    torch.testing.assert_close(torch.stack(out.outputs[0].generation_logits),
                               torch.stack(ref.outputs[0].generation_logits), atol=0, rtol=0)


def test_bad_words_are_never_completed(engine_dir):
    llm = LLM(engine_dir, threads=1)
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = PROMPTS[1]
    ref = llm.generate(prompt, SamplingParams(**greedy))[0].outputs[0].token_ids
    single = llm.generate(prompt, SamplingParams(**greedy, bad_words_ids=[[ref[0]]]))[0].outputs[0].token_ids
    assert single[0] != ref[0] and ref[0] not in single
    # a two-token word: its first token may come, never followed by its second
    pair = llm.generate(prompt, SamplingParams(**greedy, bad_words_ids=[ref[:2]]))[0].outputs[0].token_ids
    assert pair[0] == ref[0] and pair[1] != ref[1]
    assert all(pair[i:i + 2] != ref[:2] for i in range(len(pair) - 1))
    with pytest.raises(ValueError, match="bad_words_ids"):
        SamplingParams(bad_words_ids=[[]])


def test_iteration_stats_show_in_flight_batching(engine_dir):
    engine = LLMEngine(engine_dir, threads=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request(PROMPTS[0], params)
    engine.step()  # the prompt alone
    s = engine.get_stats()
    assert (s["num_iterations"], s["num_context_requests"], s["num_generation_requests"]) == (1, 1, 0)
    assert s["num_context_tokens"] == len(engine.tokenizer.encode(PROMPTS[0]))
    assert s["num_multi_request_iterations"] == s["num_mixed_iterations"] == 0
    engine.add_request(PROMPTS[1], params)  # joins while the first generates
    engine.step()
    s = engine.get_stats()
    assert (s["num_scheduled_requests"], s["num_context_requests"], s["num_generation_requests"]) == (2, 1, 1)
    assert s["num_multi_request_iterations"] == s["num_mixed_iterations"] == 1
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.get_stats()
    assert s["num_mixed_iterations"] == 1 and s["num_multi_request_iterations"] == s["num_iterations"] - 2
    assert s["num_paused_requests"] == 0
