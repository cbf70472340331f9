"""EAGLE-3 speculative decoding (kiln/models/eagle3.py, kiln/runtime/core/eagle3_proposer.py): random-weight
drafts in the published format converted beside tiny Llama-3 and Qwen3 targets. Greedy outputs equal plain
decoding's (fixed k and "auto", chunked prefill, preemption, TP 2); the drafts equal a plain-torch EAGLE-3
over HF transformers' hidden states; bad drafts and configs are refused before anything is served."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln import LLM, SamplingParams
from kiln.config import BuildConfig, ConfigError
from kiln.runtime.core.eagle3_proposer import Eagle3Proposer
from eagle3_drafts import make_draft
from tiny_models import PROMPTS

BUILD = dict(max_batch_size=8, max_input_len=128, max_seq_len=192, max_num_tokens=256, tokens_per_block=8)


def greedy(max_tokens=32, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, **kw)


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def eagle_engine(hf_model, tmp_path_factory):
    """eagle_engine(name, tp_size=1) -> (engine dir, HF target dir, draft dir)."""
    from kiln.build.builder import build_engine
    from kiln.convert.cli import convert_checkpoint

    cache = {}

    def get(name: str, tp_size: int = 1, **overrides):
        key = (name, tp_size, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            hf = hf_model(name)
            root = tmp_path_factory.mktemp(f"eagle3_{name}_tp{tp_size}")
            target = json.loads((hf / "config.json").read_text())
            n = target["num_hidden_layers"]
            draft = make_draft(root / "draft", target, layer_ids=[1, n // 2, n - 1], draft_vocab_size=256)
            ckpt = convert_checkpoint(hf, root / "ckpt", dtype="float32", tp_size=tp_size, eagle_model_dir=draft)
            engine = build_engine(ckpt, root / "engine", BuildConfig(**{**BUILD, **overrides}, backend="eager"),
                                  log=lambda *_: None)
            cache[key] = engine, hf, draft
        return cache[key]

    return get


@pytest.fixture(scope="module")
def reference(eagle_engine):
    cache = {}

    def get(name):
        if name not in cache:
            llm = LLM(eagle_engine(name)[0], enable_prefix_caching=False)
            cache[name] = tokens(llm.generate(PROMPTS, greedy()) + llm.generate(PROMPTS[:2], greedy(16, n=2)))
        return cache[name]

    return get


@pytest.mark.parametrize("name,tp,k,setting", [
    ("llama_4layers", 1, 3, "roomy"), ("llama_4layers", 1, 3, "chunked"), ("llama_4layers", 1, 2, "preempting"),
    ("llama_4layers", 1, "auto", "roomy"),
    ("qwen3", 1, 3, "roomy"), ("llama_4layers", 2, 3, "roomy"),
])
def test_greedy_outputs_equal_plain_decoding(eagle_engine, reference, name, tp, k, setting):
    kw = {"roomy": {}, "chunked": {"max_num_tokens": 16}, "preempting": {"max_tokens_in_paged_kv_cache": 160}}[setting]
    llm = LLM(eagle_engine(name, tp)[0], speculative_config={"method": "eagle3", "num_speculative_tokens": k}, **kw)
    outs = llm.generate(PROMPTS, greedy()) + llm.generate(PROMPTS[:2], greedy(16, n=2))
    assert tokens(outs) == reference(name)
    core = llm.llm_engine.core
    spec = core.stats().spec
    assert spec.num_drafts > 0 and spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens
    if setting == "preempting":
        assert core.scheduler.counters.num_preemptions > 0
    assert not core.requests and core.kv.pool.num_free == core.kv.pool.num_blocks
    assert not core.spec.proposer.followers and core.spec.proposer.kv.pool.num_free == core.spec.proposer.kv.pool.num_blocks


def reference_drafts(hf_dir: Path, draft_dir: Path, token_ids: list[int], k: int) -> list[int]:
    """EAGLE-3 in plain torch over HF transformers' hidden states: the drafts after `token_ids` (its
    last token not yet computed by the target), full causal attention, no KV cache."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    cfg = json.loads((draft_dir / "config.json").read_text())
    w = {k.replace("midlayer.", ""): v.float() for k, v in load_file(draft_dir / "model.safetensors").items()}
    with torch.no_grad():
        states = target(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    C = len(token_ids) - 1
    hidden = F.linear(torch.cat([states[j][0, :C] for j in ids], -1), w["fc.weight"])
    embed = target.get_input_embeddings().weight
    inputs = list(token_ids[1:])
    heads, kvh, D, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    rotary = target.model.rotary_emb

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    drafts = []
    for _ in range(k):
        T = hidden.shape[0]
        e = embed[torch.tensor(inputs[:T])]
        x = torch.cat([rms(e, w["input_layernorm.weight"]), rms(hidden, w["hidden_norm.weight"])], -1)
        q = F.linear(x, w["self_attn.q_proj.weight"]).view(T, heads, D).transpose(0, 1)
        kk = F.linear(x, w["self_attn.k_proj.weight"]).view(T, kvh, D).transpose(0, 1)
        v = F.linear(x, w["self_attn.v_proj.weight"]).view(T, kvh, D).transpose(0, 1)
        cos, sin = rotary(v, torch.arange(T)[None])
        q, kk = rotate(q, cos[0], sin[0]), rotate(kk, cos[0], sin[0])
        rep = heads // kvh
        a = F.scaled_dot_product_attention(q, kk.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), is_causal=True)
        residual = hidden + F.linear(a.transpose(0, 1).reshape(T, heads * D), w["self_attn.o_proj.weight"])
        m = rms(residual, w["post_attention_layernorm.weight"])
        prenorm = residual + F.linear(F.silu(F.linear(m, w["mlp.gate_proj.weight"])) * F.linear(m, w["mlp.up_proj.weight"]),
                                      w["mlp.down_proj.weight"])
        draft = int(F.linear(rms(prenorm[-1], w["norm.weight"]), w["lm_head.weight"]).argmax())
        token = draft + int(w["d2t"][draft])
        drafts.append(token)
        inputs.append(token)
        hidden = torch.cat([hidden, prenorm[-1:]])
    return drafts


def test_drafts_equal_a_plain_torch_eagle3(eagle_engine, monkeypatch):
    engine, hf, draft = eagle_engine("llama_4layers")
    seen = []
    propose = Eagle3Proposer.propose

    def spy(self, seqs, ks):
        out = propose(self, seqs, ks)
        seen.extend((list(s.token_ids), k, d) for s, k, d in zip(seqs, ks, out))
        return out

    monkeypatch.setattr(Eagle3Proposer, "propose", spy)
    llm = LLM(engine, speculative_config={"method": "eagle3", "num_speculative_tokens": 3}, enable_prefix_caching=False,
              max_num_tokens=16)  # catch-ups over chunks and over accepted drafts
    llm.generate(PROMPTS[:3], greedy(20))
    assert len(seen) > 10
    for token_ids, k, drafts in seen[::3]:
        assert drafts == reference_drafts(hf, draft, token_ids, k)


def test_the_default_models_trained_head_is_accepted(tmp_path):
    """models/kiln-tiny-stdlib-eagle3 (examples/train_eagle3.py) on its model, converted and built as
    `make demo` does: on code it was not trained on, most steps accept drafts (held out at training:
    2.19 tokens per step at k = 3)."""
    from kiln.build.builder import build_engine
    from kiln.convert.cli import convert_checkpoint

    models = Path(__file__).resolve().parents[1] / "models"
    ckpt = convert_checkpoint(models / "kiln-tiny-stdlib", tmp_path / "ckpt", dtype="bfloat16",
                              eagle_model_dir=models / "kiln-tiny-stdlib-eagle3")
    engine = build_engine(ckpt, tmp_path / "engine", BuildConfig(**BUILD, backend="eager"), log=lambda *_: None)
    prompts = ["def parse_args(argv):\n    ", "class Queue:\n    def __init__(self, maxsize=0):\n",
               "    for key, value in sorted(items):\n"]
    llm = LLM(engine, speculative_config={"method": "eagle3", "num_speculative_tokens": 3})
    llm.generate(prompts, greedy(48))
    spec = llm.llm_engine.core.stats().spec
    assert 1 + spec.num_accepted_tokens / spec.num_drafts > 1.8, spec
    assert spec.accepted_per_pos[0] > spec.accepted_per_pos[2] > 0


def test_bad_drafts_are_refused_before_serving(eagle_engine, hf_model, engine, tmp_path):
    from kiln.convert.cli import convert_checkpoint

    _, hf, draft = eagle_engine("llama_4layers")
    target = json.loads((hf / "config.json").read_text())
    cases = [
        ({**target, "hidden_size": 32, "intermediate_size": 64, "head_dim": 8}, {}, "hidden states of size 32"),
        ({**target, "vocab_size": 500}, {}, "vocab_size 500 is not the target's 384"),
        (target, {"layer_ids": [1, 2, 4]}, "must be three target layer ids in [1, 3]"),
    ]
    for i, (config, kw, message) in enumerate(cases):
        bad = make_draft(tmp_path / f"d{i}", config, **({"layer_ids": [1, 2, 3]} | kw))
        if config["hidden_size"] != target["hidden_size"]:  # the configs say the draft's own shapes
            cfg = json.loads((bad / "config.json").read_text())
            cfg["target_hidden_size"] = 32
            (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            convert_checkpoint(hf, tmp_path / f"c{i}", dtype="float32", eagle_model_dir=bad)
        assert not (tmp_path / f"c{i}").exists()
    with pytest.raises(ConfigError, match="was not built for EAGLE-3"):
        LLM(engine("llama"), speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    other = make_draft(tmp_path / "other", target, layer_ids=[3, 2, 1])
    with pytest.raises(ConfigError, match=r"reads target layers \[2, 1, 0\]"):
        LLM(eagle_engine("llama_4layers")[0], speculative_config={"method": "eagle3", "model": str(other)})
    with pytest.raises(ConfigError, match="as published; convert it beside its target"):
        LLM(eagle_engine("llama_4layers")[0], speculative_config={"method": "eagle3", "model": str(draft)})


@pytest.mark.parametrize("config,message", [
    ({"method": "eagle3", "num_speculative_tokens": 0}, "int >= 1 or \"auto\""),
    ({"method": "ngram", "model": "x"}, "model is read for method eagle3"),
    ({"decoding_type": "Medusa", "max_draft_len": 3}, "decoding_type 'Medusa' is not supported"),
    ({"method": "eagle3", "decoding_type": "NGram"}, "gives method twice"),
])
def test_bad_configs(config, message):
    from kiln.runtime.core.spec_decode import SpeculativeConfig

    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.from_dict(config)


def test_tensorrt_llm_names():
    from kiln.runtime.core.spec_decode import SpeculativeConfig

    c = SpeculativeConfig.from_dict({"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model_dir": "/d"})
    assert (c.method, c.num_speculative_tokens, c.model) == ("eagle3", 3, "/d")
    assert SpeculativeConfig.from_dict({"method": "ngram"}).num_speculative_tokens == "auto"


def test_auto_policy_drafts_only_where_it_pays():
    from kiln.runtime.core.request import Request
    from kiln.runtime.core.spec_policy import DraftPolicy
    from kiln.runtime.messages import SpecStats

    stats = SpecStats(accepted_per_pos=[0] * 4)
    policy = DraftPolicy(True, 4, stats)
    for t in (1, 2, 4, 8, 16, 32, 64):  # memory-bound up to 8 tokens, then linear
        policy.step_cost.record(t, 0.01 * max(1, t / 8))
    policy.draft_cost.record(1, 0.001)
    assert policy.step_cost.seconds(4, 4) == pytest.approx(0.01)  # until measured: the plain curve's slope
    reqs = [Request(str(i), [1], SamplingParams(), 10) for i in range(16)]
    good, bad = reqs[0], reqs[1]
    for _ in range(30):
        policy.acceptance.record(good, 4, 4)
        policy.acceptance.record(bad, 4, 0)
    stats.accepted_per_pos = [30, 30, 30, 30]
    assert policy.choose([good], [4], 0) == [4]  # batch 1, accepted: draft all
    assert policy.choose([bad], [4], 0) == [0]  # never accepted: nothing
    assert policy.choose([good], [2], 0) == [2]  # its limit
    # 16 sequences already fill the step past its memory-bound size: drafts cost more than they save
    assert sum(policy.choose(reqs[2:], [4] * 14, 0)) < 14
    assert math.isclose(policy.step_cost.seconds(12), 0.015)
    for _ in range(30):  # verification turns out to cost a plain step per draft token: none pays
        policy.step_cost.record(1 + 4, 0.01 + 4 * 0.01, drafts=4)
    assert policy.step_cost.seconds(1, 4) == pytest.approx(0.05, rel=0.01)
    assert policy.choose([good], [4], 0) == [0]
    policy.step_cost.per_draft.clear()
    policy.draft_cost.record(1, 1.0)
    policy.draft_cost.points = {1: 1.0}
    assert policy.choose([good], [4], 0) == [0]  # a draft pass slower than a step: none


def test_guided_sampled_and_cached_requests_under_eagle3(eagle_engine):
    """Greedy guided requests emit what plain guided decoding emits (drafts the grammar refuses are
    rejected, the matcher rolled back); seeded sampled requests are reproducible; a repeated prompt (a
    prefix-cache hit, whose target states the draft never saw) still decodes exactly."""
    from kiln.runtime.sampling_params import GuidedDecodingParams

    engine = eagle_engine("llama_4layers")[0]
    plain, spec = LLM(engine), LLM(engine, speculative_config={"method": "eagle3", "num_speculative_tokens": 3})
    guide = GuidedDecodingParams(regex=r"(ab|cd){3,8}[0-9]{2}")
    params = SamplingParams(temperature=0, max_tokens=24, guided_decoding=guide)
    want = [o.outputs[0].text for o in plain.generate(PROMPTS[:3], params)]
    assert [o.outputs[0].text for o in spec.generate(PROMPTS[:3], params)] == want
    # Seeded draws are reproducible where the drafts are: a sampled output depends on what was drafted,
    # and a cached prompt's drafts differ from a computed one's
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True)
    runs = [LLM(engine, speculative_config={"method": "eagle3", "num_speculative_tokens": 3},
                enable_prefix_caching=False).generate(PROMPTS, sampled) for _ in range(2)]
    assert tokens(runs[0]) == tokens(runs[1])
    again = tokens(spec.generate(PROMPTS, greedy()))  # every prompt cached by now
    assert again == tokens(plain.generate(PROMPTS, greedy()))
    assert spec.llm_engine.core.stats().spec.num_drafts > 0


def test_kiln_run_speculates_and_reports_acceptance(eagle_engine):
    import subprocess
    import sys

    engine = eagle_engine("llama_4layers")[0]
    kiln = Path(sys.executable).parent / "kiln"
    out = subprocess.run([str(kiln), "run", "--engine_dir", str(engine), "--prompt", "import json", "--max_tokens", "16",
                          "--speculative_config", '{"method": "eagle3", "num_speculative_tokens": 2}'],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "mean acceptance length" in out.stderr and "tokens drafted" in out.stderr
    bad = subprocess.run([str(kiln), "run", "--engine_dir", str(engine), "--prompt", "x",
                          "--speculative_config", '{"method": "medusa"}'], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "method 'medusa' is not supported" in bad.stderr


def test_lora_requests_under_eagle3(eagle_engine, tmp_path):
    """Adapters change the target, not the draft: its proposals are the base model's, and what the
    adapted target verifies is exactly what it emits without speculation."""
    from kiln.runtime.lora_request import LoRARequest
    from test_lora import LORA_BUILD, save_adapter

    engine, hf, _ = eagle_engine("llama_4layers", lora_config=LORA_BUILD)
    adapter = save_adapter(hf, tmp_path / "qv", 8, 16, ["q_proj", "v_proj"])
    lora = [None, LoRARequest("qv", 1, str(adapter))] * 2
    want = tokens(LLM(engine).generate(PROMPTS[:4], greedy(20), lora_request=lora))
    spec = LLM(engine, speculative_config={"method": "eagle3", "num_speculative_tokens": 3})
    assert tokens(spec.generate(PROMPTS[:4], greedy(20), lora_request=lora)) == want
    assert spec.llm_engine.core.stats().spec.num_drafts > 0
