"""Prompt and sample logprobs on a tiny random Llama (eager engine) against HF transformers' log-softmax
of the same weights: the asked-for top tokens plus the actual one, with the same values, whether the
prompt is computed at once or chunk by chunk; a sampled token outside the top n still gets its entry."""
import pytest
import torch

from kiln import SamplingParams
from runtime_helpers import assert_all_blocks_free, greedy
from runtime_helpers import chunked_llm, engine_dir, llm, reference  # noqa: F401 - fixtures
from tiny_models import PROMPTS


@pytest.fixture(scope="module")
def hf(hf_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_model("llama"), torch_dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return log_softmax


@pytest.mark.parametrize("which", ["llm", "chunked_llm"])
def test_prompt_logprobs_match_hf(which, request, hf):
    llm = request.getfixturevalue(which)
    prompts = [PROMPTS[2], PROMPTS[1]]
    outs = llm.generate(prompts, SamplingParams(prompt_logprobs=3, max_tokens=1, temperature=0))
    for out in outs:
        ids = out.prompt_token_ids
        ref = hf(ids)
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        for p in range(1, len(ids)):
            entry = plp[p]
            top = ref[p - 1].topk(3).indices.tolist()
            assert ids[p] in entry and set(top) <= entry.keys() and len(entry) in (3, 4)
            for t, lp in entry.items():
                assert lp == pytest.approx(ref[p - 1, t].item(), abs=1e-4)
    assert_all_blocks_free(llm.llm_engine)


def test_sample_logprobs_match_hf(llm, hf, reference):
    n = 3
    outs = llm.generate(PROMPTS[:2], greedy(8, logprobs=n))
    for out, ref_out in zip(outs, reference):
        c = out.outputs[0]
        assert c.token_ids == ref_out.outputs[0].token_ids[:8]
        ref = hf(out.prompt_token_ids + c.token_ids)
        P = len(out.prompt_token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        for i, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert t in entry and len(entry) in (n, n + 1)
            assert len(entry) == n  # greedy: the sampled token is the top one
            assert set(ref[P - 1 + i].topk(n).indices.tolist()) == entry.keys()
            for tid, lp in entry.items():
                assert lp == pytest.approx(ref[P - 1 + i, tid].item(), abs=1e-4)
        assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs)))
    # a sampled (not greedy) token that is not among the top n still gets its entry
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=5.0, seed=0, logprobs=1, max_tokens=16,
                                                  ignore_eos=True))[0].outputs[0]
    assert all(t in e and len(e) in (1, 2) for t, e in zip(out.token_ids, out.logprobs))
    assert any(len(e) == 2 for e in out.logprobs)
    assert_all_blocks_free(llm.llm_engine)
