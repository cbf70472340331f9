"""HF transformers is the oracle: same weights, float32, greedy tokens and logits must agree."""
import re
import zipfile

import pytest
import torch
import transformers

from kiln import LLM, SamplingParams
from kiln.engine.loader import RankEngine
from kiln.runtime.core.step_plan import plan_step, tables_of
from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.core.request import Request, Sequence
from tiny_models import PROMPTS

NEW_TOKENS = 24
# Every op a kiln:: custom-op node (the plugin path TensorRT-LLM's flags name) instead of inline code.
KILN_PLUGINS = {"plugin_config": {"rmsnorm_plugin": "python", "rope_plugin": "python", "swiglu_plugin": "python",
                                  "gpt_attention_plugin": "python", "gemm_plugin": None}}
# The norms, rope and SwiGLU on kiln_cpp's C++ ops (tests/test_cpp_elementwise.py): q/k norm on strided
# views, rope scaling.
CPP_ELEMENTWISE = {"plugin_config": {"rmsnorm_plugin": "cpp", "rope_plugin": "cpp", "swiglu_plugin": "cpp"}}
# Every family on eager, llama (whose aoti engine other tests share) on aoti too; the other
# rope-scaling variants on eager. test_hf_parity runs every family on aoti, from published configs.
# The plugin path compiled once and run eager once (q/k norm, head_dim != hidden / heads).
CASES = [("llama", "aoti", {}),
         ("llama", "eager", {}), ("mistral", "eager", {}), ("qwen2", "eager", {}), ("qwen3", "eager", {}),
         ("llama_linear", "eager", {}), ("llama_dynamic", "eager", {}),
         ("llama", "aoti", KILN_PLUGINS), ("qwen3", "eager", KILN_PLUGINS),
         ("qwen3", "eager", CPP_ELEMENTWISE), ("llama_dynamic", "eager", CPP_ELEMENTWISE)]
LABELS = {id(KILN_PLUGINS): "-kiln_plugins", id(CPP_ELEMENTWISE): "-cpp_elementwise"}
ELEMENTWISE = {"rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"}


def hf_greedy(model, prompt_ids: list[int]) -> list[int]:
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None and hasattr(rotary, "original_inv_freq"):
        # Dynamic NTK keeps state across calls; each prompt starts from a fresh model.
        rotary.inv_freq, rotary.max_seq_len_cached = rotary.original_inv_freq, rotary.original_max_seq_len
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
    return out[0, ids.shape[1]:].tolist()


def engine_logits(engine: RankEngine, token_lists: list[list[int]],
                  sequence_len: int | None = None) -> list[torch.Tensor]:
    """Logits at every position of each sequence, the sequences prefilled together in one step; a LongRoPE
    engine picks the factors by `sequence_len` (default: each sequence's length)."""
    bs = engine.config.build_config.tokens_per_block
    out, next_block = SchedulerOutput(), 0
    for tokens in token_lists:
        req = Request("r", tokens, SamplingParams(prompt_logprobs=0), len(tokens))
        seq = Sequence(req, 0, list(tokens))
        nblocks = -(-len(tokens) // bs)
        seq.block_table = list(range(next_block, next_block + nblocks))
        next_block += nblocks
        out.scheduled.append((seq, len(tokens)))
    plan = plan_step(out, bs, tables_of([seq for seq, _ in out.scheduled]),
                     bool(engine.config.pretrained_config.long_rope_threshold))
    if sequence_len is not None and "sequence_lens" in plan.inputs:
        plan.inputs["sequence_lens"].fill_(sequence_len)
    logits = engine(plan.inputs)
    result = []
    for (seq, _), (_, _, rows), (_, last) in zip(out.scheduled, plan.prompt_rows, plan.sample):
        result.append(logits[rows + [last]])
    return result


def kiln_ops(engine_dir, namespace="kiln") -> set[str]:
    """The torch.ops.<namespace> ops an engine's graph calls (from the serialized graph of an eager
    engine, the proxy-executor nodes or generated C++ of an AOTInductor package)."""
    found = set()
    with zipfile.ZipFile(engine_dir / "rank0.engine") as z:
        for name in z.namelist():
            if name.endswith((".json", ".cpp")):
                found |= set(re.findall(rf"\b{namespace}(?:\.|::)(\w+)", z.read(name).decode(errors="replace")))
    return found


@pytest.fixture(scope="module")
def hf_models(hf_model):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = transformers.AutoModelForCausalLM.from_pretrained(
                hf_model(name), torch_dtype=torch.float32).eval()
        return cache[name]

    return get


@pytest.mark.parametrize("name,backend,overrides", CASES,
                         ids=[f"{n}-{b}" + LABELS.get(id(o), "") for n, b, o in CASES])
def test_greedy_matches_hf(name, backend, overrides, engine, hf_models, capsys):
    engine_dir = engine(name, backend, **overrides)
    if overrides is KILN_PLUGINS:  # the engine really calls the kiln:: ops, not inline code
        assert ELEMENTWISE | {"kv_cache_write", "paged_attention"} <= kiln_ops(engine_dir)
    if overrides is CPP_ELEMENTWISE:
        assert ELEMENTWISE <= kiln_ops(engine_dir, "kiln_cpp") and not ELEMENTWISE & kiln_ops(engine_dir)
    llm = LLM(engine_dir)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    lengths = sorted({len(o.prompt_token_ids) for o in outs})
    assert len(lengths) >= 4, f"prompts should differ in length, got {lengths}"
    model = hf_models(name)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(model, out.prompt_token_ids), out.prompt

    # Logits of the full (prompt + generated) sequences against HF's forward pass.
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    if name == "llama_dynamic":
        sequences = [s[:model.config.max_position_embeddings] for s in sequences]  # HF rescales per call
    runner = RankEngine(engine_dir, max_tokens_in_paged_kv_cache=4096)
    ours = engine_logits(runner, sequences[:2]) + [engine_logits(runner, [s])[0] for s in sequences[2:]]
    worst = 0.0
    for seq, got in zip(sequences, ours):
        with torch.no_grad():
            ref = model(torch.tensor([seq])).logits[0]
        worst = max(worst, (got - ref).abs().max().item())
    with capsys.disabled():
        print(f"\n[{name}/{backend}{LABELS.get(id(overrides), '')}] max |logit - HF logit| = {worst:.2e}")
    assert worst < 1e-3


def test_batch_1_engine_with_few_blocks_per_sequence(engine, hf_models):
    """Limits below the sizes of the step export traces with (3 decodes, 5 blocks per sequence):
    the build still succeeds, and the engine serves one request at a time."""
    engine_dir = engine("llama", max_batch_size=1, max_input_len=24, max_seq_len=32, max_num_tokens=24)
    llm = LLM(engine_dir)
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(hf_models("llama"), out.prompt_token_ids)[:6], out.prompt


def test_aoti_engine_writes_the_pool_in_place(engine):
    """The compiled step updates the KV pool passed in; it neither copies nor replaces it."""
    runner = RankEngine(engine("llama", "aoti"), max_tokens_in_paged_kv_cache=256)
    pool, ptr = runner.kv_cache, runner.kv_cache.data_ptr()
    req = Request("r", list(range(3, 20)), SamplingParams(), 1)
    seq = Sequence(req, 0, list(req.prompt_token_ids))
    seq.block_table = [5, 2, 30]  # scattered pages
    plan = plan_step(SchedulerOutput([(seq, 17)]), 8, tables_of([seq]))
    runner(plan.inputs)
    assert runner.kv_cache is pool and pool.data_ptr() == ptr
    written = pool.abs().sum(dim=(0, 1, 3, 4, 5)) > 0
    assert written.nonzero().flatten().tolist() == [2, 5, 30]
