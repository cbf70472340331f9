"""What the runtime's end-to-end test files share (test_llm_api.py, test_inflight_batching.py,
test_logprobs.py, test_stops.py, test_async_llm.py, test_beam_search.py): greedy parameters, the
check that every KV block is back in the pool, and module-scoped fixtures of a tiny random Llama
(eager engine) and LLMs on it. A test file imports the fixtures it uses and gets LLMs of its own.

Greedy outputs of one LLM with default settings (`reference`) are the yardstick the other
configurations must reproduce token for token."""
import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.frontend.llm_engine import LLMEngine
from tiny_models import PROMPTS

MAX_TOKENS = 16
# Prompt 3 also asks for prompt logprobs, so that every configuration compares them too.
PLP = 3


def greedy(max_tokens=MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, **kw)


def ref_params() -> list[SamplingParams]:
    return [greedy(prompt_logprobs=1) if i == PLP else greedy() for i in range(len(PROMPTS))]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    """Nothing in flight, every block in the pool's free list once, no references, no reservations."""
    core = engine.core
    kv, pool = core.kv, core.kv.pool
    assert not engine.has_unfinished_requests() and not core.requests
    assert not core.scheduler.running and not core.scheduler.waiting
    assert pool.num_free == pool.num_blocks
    assert sorted(pool.free) == list(range(pool.num_blocks))  # each block once
    assert all(c == 0 for c in pool.ref_counts)
    assert kv.reserved == 0


def assert_text_is_decode(tok, outputs) -> None:
    for out in outputs:
        for c in out.outputs:
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True), (c.finish_reason, c.token_ids)


def close_logprobs(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], abs=tol), k


# --------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def engine_dir(engine):
    return engine("llama")


@pytest.fixture(scope="module")
def llm(engine_dir):
    return LLM(engine_dir)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


@pytest.fixture(scope="module")
def reference(llm):
    outs = llm.generate(PROMPTS, ref_params())
    assert_all_blocks_free(llm.llm_engine)
    return outs


@pytest.fixture(scope="module")
def chunked_llm(engine_dir):
    return LLM(engine_dir, max_num_tokens=16, enable_prefix_caching=False)  # every chunk computed
