"""Speculative decoding (kiln/runtime/core/spec_decode.py): prompt lookup and a draft engine. Greedy
outputs equal plain decoding's under in-flight batching (speculating and plain sequences in one
step, chunked prefill, preemption, n > 1); sampled outputs follow the same distribution (a
chi-square test of the verification against the sampler's own distribution); the counters add up."""
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.config import ConfigError
from kiln.runtime.core.sample.rows import SampleRow, make_generator
from kiln.runtime.core.sample.sampler import Sampler
from kiln.runtime.core.spec_decode import NgramProposer, SpeculativeConfig, target_probs, verify
from test_sampler import chi2_pvalue
from tiny_models import PROMPTS

ALPHA = 1e-4
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def greedy(max_tokens=40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, **kw)


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def engine_dir(engine):
    return engine("llama")


@pytest.fixture(scope="module")
def draft_dir(engine):
    return engine("llama_draft")


@pytest.fixture(scope="module")
def reference(engine_dir):
    llm = LLM(engine_dir, enable_prefix_caching=False)
    return llm.generate(PROMPTS, greedy()) + llm.generate(PROMPTS[:2], greedy(24, n=2))


def methods(draft_dir):
    return {"ngram": NGRAM, "draft_model": {"method": "draft_model", "draft_engine_dir": str(draft_dir),
                                            "num_speculative_tokens": 3}}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("setting", ["roomy", "chunked", "preempting"])
def test_greedy_outputs_equal_plain_decoding(engine_dir, draft_dir, reference, method, setting):
    kw = {"roomy": {}, "chunked": {"max_num_tokens": 16}, "preempting": {"max_tokens_in_paged_kv_cache": 160}}[setting]
    llm = LLM(engine_dir, speculative_config=methods(draft_dir)[method], **kw)
    outs = llm.generate(PROMPTS, greedy()) + llm.generate(PROMPTS[:2], greedy(24, n=2))
    assert tokens(outs) == tokens(reference)
    core = llm.llm_engine.core
    spec = core.stats().spec
    assert spec.num_drafts > 0 and 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens
    assert spec.accepted_per_pos == sorted(spec.accepted_per_pos, reverse=True)  # position j needs j - 1
    assert sum(o.metrics.num_accepted_tokens for o in outs) == spec.num_accepted_tokens
    assert sum(o.metrics.num_draft_tokens for o in outs) == spec.num_draft_tokens
    if setting == "preempting":
        assert core.scheduler.counters.num_preemptions > 0
    assert not core.requests and core.kv.pool.num_free == core.kv.pool.num_blocks


def test_sampled_speculation_is_seeded_and_reproducible(engine_dir):
    llm = LLM(engine_dir, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=32, ignore_eos=True, n=2, logprobs=2)
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS[::-1], params)[::-1]  # other batch places, the same draws
    assert tokens(first) == tokens(again)
    for out in first:
        for c in out.outputs:
            assert len(c.token_ids) == 32 and len(c.logprobs) == 32
            assert all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
    assert llm.llm_engine.core.stats().spec.num_accepted_tokens > 0


def test_ngram_proposals():
    p = NgramProposer(SpeculativeConfig.from_dict(NGRAM))
    # "7 8" occurred twice before: the later one is followed by 3 tokens only, the earlier by 4
    assert p._lookup([1, 7, 8, 9, 10, 11, 12, 5, 7, 8, 1, 7, 8], 4) == [9, 10, 11, 12]
    assert p._lookup([1, 7, 8, 9, 10, 11, 12, 5, 7, 8, 1, 3, 7, 8], 4) == [1, 3, 7, 8]  # the latest
    assert p._lookup([5, 5, 5, 5], 4) == [5]  # only one token follows the latest "5 5 5"
    assert p._lookup([1, 2, 3], 4) == []
    assert p._lookup([256, 1, 256], 2) == [1, 256]  # no match across token boundaries of the bytes


@pytest.mark.parametrize("bad, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs draft_engine_dir"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown key"),
])
def test_bad_speculative_configs(bad, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_dict(bad)


# --------------------------------------------------------------------------- the distribution
def emitted(sampler, logits: torch.Tensor, params: SamplingParams, drafts: list[int], n: int,
            output=(5,)) -> list[list[int]]:
    """n verifications of the same drafts against the same target rows, each seeded differently."""
    rows = [SampleRow(params, [1, 2], list(output), make_generator(seed)) for seed in range(n)]
    big = logits.repeat(n, 1)
    return [v.token_ids for v in verify(sampler, big, rows, [drafts] * n)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.5),
], ids=["plain", "top_k", "top_p", "min_p_penalty"])
def test_speculated_tokens_follow_the_sampled_distribution(params):
    """The first token emitted must be distributed as the sampler's own distribution at that
    position, and the second (after the first draft was accepted) as its distribution with the
    first draft in the output, whatever the drafts are."""
    g = torch.Generator().manual_seed(0)
    V, n = 12, 20_000
    logits = torch.randn(3, V, generator=g) * 1.5
    sampler = Sampler("torch")
    drafts, ref = [], []
    for j in range(3):  # each draft the target's second most likely token there: accepted at times
        ref.append(target_probs(sampler, logits[j:j + 1], [SampleRow(params, [1, 2], [5] + drafts)])[0])
        drafts.append(int(ref[-1].argsort(descending=True)[1]))
    drafts = drafts[:2]
    assert ref[0][drafts[0]] > 0.02 and ref[1][drafts[1]] > 0.02
    out = emitted(sampler, logits, params, drafts, n)
    first = torch.bincount(torch.tensor([t[0] for t in out]), minlength=V)
    assert chi2_pvalue(first, ref[0]) > ALPHA
    assert (first[ref[0] == 0] == 0).all()  # nothing outside the top-k / top-p / min-p set
    second = [t[1] for t in out if t[0] == drafts[0]]
    assert len(second) > 200
    assert chi2_pvalue(torch.bincount(torch.tensor(second), minlength=V), ref[1]) > ALPHA
    # all drafts accepted: the bonus token comes from the last position's distribution
    bonus = [t[2] for t in out if t[:2] == drafts]
    if len(bonus) > 200:
        assert chi2_pvalue(torch.bincount(torch.tensor(bonus), minlength=V), ref[2]) > ALPHA
