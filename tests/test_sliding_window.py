"""Sliding-window attention: the paged-attention plugins (C++ and inline) against the reference with a
window, pages wholly before every query's window never read; and engines of models that slide. Also
the scores' soft cap (Gemma 2), with and without a window."""
import zlib

import pytest
import torch

from kiln.plugins import cpp, cpu, reference
from test_plugins import BF16_TOL, F32_TOL, HEADS, STEPS, _args, _make_step

WINDOWS = [1, 7, 16, 40, 129]


def _step(step, block_size, heads, window):
    kv_heads, num_heads = HEADS[heads]
    seed = zlib.crc32(f"window/{step}/{block_size}/{heads}/{window}".encode())
    return _make_step(STEPS[step], layers=2, kv_heads=kv_heads, heads=num_heads, head_dim=32,
                      block_size=block_size, seed=seed, extra_q_pad=3, extra_block_pad=2)[0]


def _freed(inputs, window: int):
    """The step with every block-table entry wholly before its request's window pointing at a block of
    NaNs (int8: of 127s), as the KV cache manager leaves a sliding model's blocks once it has freed them."""
    cache = inputs["kv_cache"]
    bs = cache.shape[3]
    nan = torch.full_like(cache[:, :, :1], 127 if cache.dtype == torch.int8 else float("nan"))
    out = dict(inputs, kv_cache=torch.cat([cache, nan], dim=2))
    freed = 0
    for kind in ("ctx", "gen"):
        tables = out[f"{kind}_block_tables"].clone()
        for i, length in enumerate(out[f"{kind}_context_lens"].tolist()):
            new = int((out["ctx_token_index"][i] >= 0).sum()) if kind == "ctx" else 1
            first_key = max(0, length - new - window + 1)
            tables[i, : first_key // bs] = cache.shape[2]
            freed += first_key // bs
        out[f"{kind}_block_tables"] = tables
    assert freed, "the step frees no page: the test would not show that they are skipped"
    return out


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", ["mha", "gqa8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_op_slides_and_skips_freed_pages(window, heads, dtype):
    inputs = _step("mixed", 16, heads, window)
    expected = reference.paged_attention(*_args(inputs), window=window)
    freed = _freed(inputs, window)
    q, cache = freed["q"].to(dtype), freed["kv_cache"].to(dtype)  # bf16: the context tiles' bf16 kernel
    got = cpp.paged_attention_op()(q, cache, *_args(freed)[2:], window=window)
    assert not got.isnan().any()
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    want = expected if dtype == torch.float32 else reference.paged_attention(
        inputs["q"].to(dtype).float(), inputs["kv_cache"].to(dtype).float(), *_args(inputs)[2:], window=window)
    torch.testing.assert_close(got.float(), want, **tol)
    # A window as long as every sequence is no window at all.
    full = cpp.paged_attention_op()(*_args(inputs), window=10_000)
    torch.testing.assert_close(full, reference.paged_attention(*_args(inputs)), **F32_TOL)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_cpp_op_slides_over_8bit_pages(kv_dtype):
    from test_cpp_attention import _8bit_pool

    inputs = _step("mixed", 16, "gqa3", 40)
    q, cache, *rest = _args(inputs)
    pool, kv_scale = _8bit_pool(cache, kv_dtype)
    expected = reference.paged_attention(q, pool, *rest, kv_scale=kv_scale, window=40)
    freed = _freed(dict(inputs, kv_cache=pool), 40)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # flash-decoding partitions of the 1000-token decodes, from the window on
        got = cpp.paged_attention_op()(q, freed["kv_cache"], *_args(freed)[2:], kv_scale, window=40)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, **F32_TOL)


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores(window, dtype):
    inputs = _step("mixed", 16, "gqa3", 40)
    inputs["q"] = inputs["q"] * 4  # scores well past the cap of 5, where tanh bends them
    args = _args(dict(inputs, q=inputs["q"].to(dtype), kv_cache=inputs["kv_cache"].to(dtype)))
    want = reference.paged_attention(args[0].float(), args[1].float(), *args[2:], window=window, softcap=5.0)
    uncapped = reference.paged_attention(args[0].float(), args[1].float(), *args[2:], window=window)
    assert (want - uncapped).abs().max() > 0.1
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    for op in (cpp.paged_attention_op(), cpu.paged_attention):
        torch.testing.assert_close(op(*args, window=window, softcap=5.0).float(), want, **tol)


@pytest.mark.parametrize("window", [7, 40])
def test_inline_attention_slides(window):
    inputs = _step("mixed", 16, "gqa8", window)
    torch.testing.assert_close(cpu.paged_attention(*_args(inputs), window=window),
                               reference.paged_attention(*_args(inputs), window=window), **F32_TOL)


def test_window_must_not_be_negative():
    inputs = _step("gen_only", 16, "mha", 1)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        cpp.paged_attention_op()(*_args(inputs), window=-1)


NEW_TOKENS = 80  # the longest prompt (109 tokens) + 80 fits max_seq_len 192


def _hf_greedy(model_dir, prompts, **config) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **config).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    outs = []
    for p in prompts:  # one at a time: no padding for a window to meet
        ids = torch.tensor([tok(p)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             min_new_tokens=NEW_TOKENS, pad_token_id=tok.pad_token_id)
        outs.append(out[0, ids.shape[1]:].tolist())
    return outs


def test_sliding_model_matches_hf_far_past_its_window_holding_few_blocks(engine, hf_model, monkeypatch):
    from kiln import LLM, SamplingParams
    from kiln.runtime.core.kv_cache_manager import KVCacheManager
    from tiny_models import PROMPTS

    model_dir = hf_model("mistral_window")  # a 12-token window on every layer, 8-token blocks
    want = _hf_greedy(model_dir, PROMPTS)
    assert want != _hf_greedy(model_dir, PROMPTS, sliding_window=None), "the window changes nothing HF generates"

    held = []  # blocks a decoding sequence holds after each allocation
    allocate = KVCacheManager.allocate_slots

    def recording(self, seq, n, headroom=0):
        ok = allocate(self, seq, n, headroom)
        if seq.num_computed_tokens >= seq.request.num_prompt_tokens:
            held.append(sum(b >= 0 for b in seq.block_table))
        return ok

    monkeypatch.setattr(KVCacheManager, "allocate_slots", recording)
    llm = LLM(engine("mistral_window"))
    try:
        assert llm.llm_engine.core.kv.window == 12
        # min_tokens: the end-of-sequence token suppressed until then, as HF's min_new_tokens does
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
        for _ in range(2):  # the second time from the prefix cache, blocks dropped from sequences included
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
        # The next query's window (12 keys) and its own block: at most 3 blocks of 8, whatever the length.
        assert held and max(held) <= 3, max(held)
        pool = llm.llm_engine.core.kv.pool
        assert pool.num_free == pool.num_blocks
    finally:
        llm.llm_engine.shutdown()


def test_soft_capped_gemma2_matches_hf_logits(engine, hf_model):
    """Soft caps that bend (scores at 2, logits at 3) where HF's eager attention applies them (the C++
    op's cap: test_soft_capped_scores; a compiled Gemma 2: test_hf_parity)."""
    import transformers

    from kiln.engine.loader import RankEngine
    from test_e2e import engine_logits

    model_dir = hf_model("gemma2_capped")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids = [[5, 17, 33, 80, 120, 7, 9, 44, 61, 3, 250, 31, 8, 77, 19, 200, 42, 11, 90, 6]]  # past the 12-key window
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits[0]
    assert want.abs().max() <= 3.0 and want.abs().max() > 2.0  # the final cap bites
    got = engine_logits(RankEngine(engine("gemma2_capped")), ids)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
