"""Beam search against HF transformers' `generate(num_beams=k)` on tiny random Llama and Qwen2 models
(float32 eager engines): the same hypotheses in the same order with the same scores, for widths 2
and 4, length penalties and every early_stopping; then the same results mixed into a batch with
plain requests under preemption, the prefix cache and guaranteed_no_evict, with every block back."""
import pytest
import torch

from conftest import TEST_BUILD
from kiln import LLM, SamplingParams
from kiln.runtime.messages import request_blocks
from runtime_helpers import assert_all_blocks_free
from tiny_models import PROMPTS

MAX_TOKENS = 12
TPB = TEST_BUILD["tokens_per_block"]
# (width, length_penalty, early_stopping, with a second stop token that the beams meet)
CASES = [(2, 1.0, False, False), (4, 1.0, False, False), (4, 0.5, True, False), (4, 2.0, "never", False),
         (2, 1.0, False, True), (4, -1.0, False, True), (4, 1.0, True, True)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, hf_model, engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = request.param
    hf = AutoModelForCausalLM.from_pretrained(hf_model(name), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf_model(name))
    return name, hf, tok, engine(name, max_beam_width=4)  # the key tests/test_serve.py builds too


def hf_beams(hf, ids: list[int], width: int, length_penalty: float, early_stopping, eos: list[int],
             max_tokens: int = MAX_TOKENS) -> tuple[list[list[int]], list[float]]:
    out = hf.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width, max_new_tokens=max_tokens,
                      do_sample=False, length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                      return_dict_in_generate=True, output_scores=True)
    seqs = []
    for s in out.sequences.tolist():
        s = s[len(ids):]
        end = next((j + 1 for j, t in enumerate(s) if t in eos), len(s))  # HF pads after a stop token
        seqs.append(s[:end])
    return seqs, out.sequences_scores.tolist()


def stop_token(hf, ids: list[int]) -> int:
    """A token the beams meet early: the 4th of the greedy output."""
    return hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids) + 3].item()


def beam_params(width, length_penalty, early_stopping, stop_ids=(), **kw) -> SamplingParams:
    return SamplingParams(use_beam_search=True, n=width, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                          early_stopping=early_stopping, stop_token_ids=list(stop_ids), **kw)


@pytest.fixture(scope="module")
def expected(model):
    """Per (case, prompt): the prompt ids, Kiln's params and HF's hypotheses and scores."""
    name, hf, tok, _ = model
    cases = []
    for width, lp, es, with_stop in CASES:
        for prompt in PROMPTS[:3]:
            ids = tok.encode(prompt)
            stops = [stop_token(hf, ids)] if with_stop else []
            seqs, scores = hf_beams(hf, ids, width, lp, es, [1] + stops)
            cases.append((ids, beam_params(width, lp, es, stops), seqs, scores))
    return cases


def check(outputs, seqs, scores, length_penalty) -> None:
    assert [c.token_ids for c in outputs] == seqs
    got = [c.cumulative_logprob / len(c.token_ids) ** length_penalty for c in outputs]
    # float32 noise, times the length for length_penalty -1 (scores near -480): relative too
    assert got == pytest.approx(scores, rel=1e-6, abs=1e-4)


def test_beam_search_matches_hf(model, expected):
    name, _, _, engine_dir = model
    llm = LLM(engine_dir)
    finished_by_stop = 0
    for ids, params, seqs, scores in expected:
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        check(out.outputs, seqs, scores, params.length_penalty)
        for c in out.outputs:
            assert c.finish_reason == ("stop" if c.token_ids[-1] in [1, *params.stop_token_ids] else "length")
            assert c.stop_reason == (c.token_ids[-1] if c.finish_reason == "stop" and c.token_ids[-1] != 1 else None)
        finished_by_stop += any(c.finish_reason == "stop" for c in out.outputs)
    assert finished_by_stop >= 3  # the stop-token cases end beams early, and the searches with them
    assert_all_blocks_free(llm.llm_engine)


def test_n_best_of(model, expected):
    """best_of beams, the n best returned; the same as the first n of a width-best_of search."""
    llm = LLM(model[3])
    ids, params, seqs, scores = next(e for e in expected if e[1].beam_width == 4)
    out = llm.generate([{"prompt_token_ids": ids}], beam_params(2, params.length_penalty, params.early_stopping,
                                                                 params.stop_token_ids, best_of=4), use_tqdm=False)[0]
    check(out.outputs, seqs[:2], scores[:2], params.length_penalty)


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_beams_batched_with_preemption_and_prefix_cache(model, expected, policy):
    """Every search of `expected` and greedy requests in one batch, twice (the second time the prompts
    come from the prefix cache), on a KV cache too small for all of them at once."""
    name, hf, tok, engine_dir = model
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=MAX_TOKENS)
    prompts = [{"prompt_token_ids": ids} for ids, *_ in expected] + [{"prompt_token_ids": tok.encode(p)}
                                                                     for p in PROMPTS[:4]]
    params = [p for _, p, *_ in expected] + [greedy] * 4
    longest = max(len(ids) for ids, *_ in expected)
    blocks = request_blocks(longest, longest + MAX_TOKENS, 4, TPB)[0] + 1  # one width-4 search at a time
    llm = LLM(engine_dir, scheduler_policy=policy, max_tokens_in_paged_kv_cache=blocks * TPB)
    alone = [o.outputs[0].token_ids for o in LLM(engine_dir).generate(prompts[-4:], greedy, use_tqdm=False)]
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, (_, p, seqs, scores) in zip(outs, expected):
            check(out.outputs, seqs, scores, p.length_penalty)
        assert [o.outputs[0].token_ids for o in outs[len(expected):]] == alone
        assert_all_blocks_free(llm.llm_engine)
    counters = llm.llm_engine.core.scheduler.counters
    if policy == "max_utilization":
        assert counters.num_preemptions > 0
    assert counters.prefix_cache_hits > 0


def test_beam_search_errors(model):
    engine_dir = model[3]
    with pytest.raises(ValueError, match="use_beam_search does not support top_p, logprobs"):
        SamplingParams(use_beam_search=True, n=2, top_p=0.9, logprobs=1)
    with pytest.raises(ValueError, match="best_of .* needs use_beam_search"):
        SamplingParams(n=1, best_of=2)
    with pytest.raises(ValueError, match="early_stopping must be"):
        SamplingParams(use_beam_search=True, n=2, early_stopping="sometimes")
    llm = LLM(engine_dir)
    with pytest.raises(ValueError, match=r"beam width 8 exceeds the engine's max_beam_width \(4\)"):
        llm.generate(["x"], SamplingParams(use_beam_search=True, n=8), use_tqdm=False)


def test_beams_beside_speculating_requests(model, expected):
    """With ngram speculation on, beams are never drafted for and keep HF's results, while greedy
    requests beside them still speculate."""
    name, hf, tok, engine_dir = model
    llm = LLM(engine_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24)
    prompts = [{"prompt_token_ids": ids} for ids, *_ in expected[:6]] + [{"prompt_token_ids": tok.encode(PROMPTS[2])}]
    outs = llm.generate(prompts, [p for _, p, *_ in expected[:6]] + [greedy], use_tqdm=False)
    for out, (_, p, seqs, scores) in zip(outs[:-1], expected):
        check(out.outputs, seqs, scores, p.length_penalty)
    assert outs[-1].metrics.num_draft_tokens > 0
    assert_all_blocks_free(llm.llm_engine)
