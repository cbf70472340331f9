"""GEMM tactics timed at engine build (kiln.plugins.tactics): the table engine-build records and
prints, the timing cache, engines moved between CPUs with different instruction sets (kernels
capped by KILN_CPU_ISA in a subprocess), int8 activations and the quantized lm_head."""
import json
import os
import subprocess
import sys

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.build.builder import build_engine
from kiln.config import BuildConfig, ConfigError
from kiln.plugins import tactics

from test_gemm import assert_same_greedy
from tiny_models import PROMPTS

BUILD = dict(max_batch_size=8, max_input_len=128, max_seq_len=192, max_num_tokens=256, tokens_per_block=8,
             backend="eager")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build(ckpt, out, log=None, verbose=False, **overrides):
    build = BuildConfig(**{**BUILD, **overrides})
    build.plugin_config["gemm_plugin"] = "cpp"
    build_engine(ckpt, out, build, log=log or (lambda *_: None), verbose=verbose)
    return json.loads((out / "config.json").read_text())["build_config"]


def _generate(engine_dir, env=None):
    """Greedy tokens and top log-probs, in this process or (env) in a subprocess with that environment."""
    if env is None:
        outs = LLM(engine_dir).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], ""
    script = ("import json, sys; sys.path.insert(0, 'tests'); import test_gemm_tactics as t\n"
              f"tokens, lps, _ = t._generate({str(engine_dir)!r})\n"
              "print(json.dumps([tokens, [[{str(k): v for k, v in d.items()} for d in s] for s in lps]]))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens, lps = json.loads(proc.stdout.strip().splitlines()[-1])
    return tokens, [[{int(k): v for k, v in d.items()} for d in s] for s in lps], proc.stderr


def test_build_records_prints_and_caches_tactics(checkpoint, tmp_path):
    ckpt, cache = checkpoint("llama", "bfloat16"), tmp_path / "timing.json"
    lines = []
    config = _build(ckpt, tmp_path / "a", log=lines.append, timing_cache=str(cache))
    table, buckets = config["gemm_tactics"], tactics.buckets(BUILD["max_num_tokens"])
    # qkv, dense, gate_up, proj and the lm_head (float32 logits): one entry per distinct GEMM
    assert len(table) == 5 and sum(e["layers"] for e in table.values()) == 4 * 2 + 1
    names = set(tactics.kernel_ids())
    for entry in table.values():
        assert [row["m_max"] for row in entry["buckets"]] == buckets
        for row in entry["buckets"]:
            assert row["kernel"] in names and row["us"][row["kernel"]] == min(row["us"].values())
    assert set(config["cpu_features"]) <= set(tactics.cpu_features())
    printed = "\n".join(lines)
    # by default one line per GEMM, the kernel per token range; the timings behind --log_level verbose
    assert "GEMM kernels chosen" in printed and "M <=   256:" not in printed and "the engine's kernels need" in printed
    assert all(f"{key} (" in printed and " for M 1" in printed for key in table)
    load = config["tactic_timing_load"]  # how busy the machine was, and the buckets timed again for noise
    assert load["buckets"] == len(table) * len(buckets) and 0 <= load["retimed"] <= load["buckets"]
    assert "machine load while timing: other processes took" in printed
    assert cache.is_file()
    lines.clear()
    again = _build(ckpt, tmp_path / "b", log=lines.append, timing_cache=str(cache), verbose=True)
    assert "(0 measured," in "\n".join(lines) and "M <=   256:" in "\n".join(lines)
    assert again["gemm_tactics"] == table


def test_machine_load_sees_another_busy_process():
    """Tactic timing's load figure counts the CPU that other processes take (here a busy loop)."""
    load = tactics.MachineLoad()
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"])
    busy.wait()
    assert load.other_cpus() > tactics.LOADED_CPUS


def test_bad_timing_cache_and_lm_head_without_plugin(checkpoint, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="is not a kiln timing cache"):
        _build(checkpoint("llama", "bfloat16"), tmp_path / "e", timing_cache=str(bad))
    build = BuildConfig(**BUILD, quantize_lm_head=True)
    with pytest.raises(ConfigError, match="--quantize_lm_head needs the C\\+\\+ GEMM plugin"):
        build_engine(checkpoint("llama", "bfloat16"), tmp_path / "f", build, log=lambda *_: None)


def test_engines_move_between_instruction_sets(checkpoint, tmp_path):
    """An engine timed here runs where its kernels are missing (KILN_CPU_ISA=avx2: no AVX-512 / AMX)
    through the fallback, and one timed on such a CPU runs here; both generate the same tokens."""
    if "avx2" not in tactics.cpu_features():
        pytest.skip("this CPU lacks avx2")
    ckpt = checkpoint("llama", "bfloat16")
    here = _build(ckpt, tmp_path / "here")
    tokens, lps, _ = _generate(tmp_path / "here")
    moved, moved_lps, stderr = _generate(tmp_path / "here", {"KILN_CPU_ISA": "avx2"})
    assert_same_greedy(moved, tokens, lps)
    if not set(here["cpu_features"]) - {"avx2"}:
        return  # an AVX2-only CPU: the engine timed here is the one an AVX2 build would give
    assert "which this CPU lacks; running" in stderr
    script = ("import sys; sys.path.insert(0, 'tests'); import test_gemm_tactics as t\n"
              f"print(t._build({str(ckpt)!r}, __import__('pathlib').Path({str(tmp_path / 'avx2')!r}))['cpu_features'])\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "KILN_CPU_ISA": "avx2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] in ("['avx2']", "[]")
    back, _, _ = _generate(tmp_path / "avx2")
    assert_same_greedy(back, tokens, lps)


def _forced_agreement(engine_dir, continuations) -> float:
    """The share of PROMPTS' continuation steps at which the engine's own top token is the given one."""
    llm = LLM(engine_dir)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    hits = total = 0
    for p, c, out in zip(prompts, continuations, outs):
        for step, token in enumerate(c):
            ranked = out.prompt_logprobs[len(p) + step]
            hits += max(ranked, key=ranked.get) == token
            total += 1
    return hits / total


def test_int8_activations_and_quantized_lm_head(hf_model, tmp_path):
    """An int4 (RTN) engine with int8 activations allowed (the default) and, by default, an int8 lm_head
    whose packed table the tied embedding shares: recorded in the config, a smaller engine, and the
    float-activation, bf16-head engine's tokens up to near ties; --quantize_lm_head int4 and none as asked."""
    from kiln.convert.cli import convert_checkpoint
    from kiln.convert.quantize.pipeline import QuantOptions

    ckpt = convert_checkpoint(hf_model("llama"), tmp_path / "ckpt", dtype="bfloat16",
                              quant=QuantOptions("int4_wo", None, 32, eval_size=0))
    assert BuildConfig().int8_activations
    plain = _build(ckpt, tmp_path / "plain", int8_activations=False, quantize_lm_head="none")
    fast = _build(ckpt, tmp_path / "fast")
    int4_head = _build(ckpt, tmp_path / "int4_head", quantize_lm_head="int4")
    assert fast["int8_activations"] and not plain["int8_activations"]
    heads = (plain["quantize_lm_head"], fast["quantize_lm_head"], int4_head["quantize_lm_head"])
    assert heads == ("none", "int8", "int4")

    def head_format(config):
        return next(k for k in config["gemm_tactics"] if "_f32out" in k).split("_")[2]

    assert (head_format(plain), head_format(fast), head_format(int4_head)) == ("bfloat16", "int8", "uint8")
    head = next(e for k, e in fast["gemm_tactics"].items() if "_f32out" in k)
    int8_kernels = {"avx2_int8", "avx512_vnni", "portable_int8"}
    assert any(set(row["us"]) & int8_kernels for row in head["buckets"])  # int8 kernels were candidates
    assert not any(set(row["us"]) & int8_kernels for e in plain["gemm_tactics"].values() for row in e["buckets"])
    tokens, lps, _ = _generate(tmp_path / "plain")
    for name in ("fast", "int4_head"):
        # lm_head rounding moves logits more than int8 activations do: compare loosely, each step fed the
        # plain engine's tokens (free-running, one early flip on the random model's near ties would
        # decide every later step)
        agree = _forced_agreement(tmp_path / name, tokens)
        assert agree >= 0.5, (name, agree)
    size = lambda d: sum(f.stat().st_size for f in d.iterdir())  # noqa: E731
    vocab, hidden = 384, 64  # tiny_models' llama: the bf16 table is vocab * hidden * 2 bytes, held once
    assert size(tmp_path / "fast") < size(tmp_path / "plain") - vocab * hidden // 2  # bf16 -> int8, scales aside
    assert size(tmp_path / "int4_head") < size(tmp_path / "fast")


def test_slow_kernels_are_pruned_but_never_amx(monkeypatch):
    """A kernel 4x behind at two buckets in a row is not timed at larger ones, except AMX's, whose call
    is mostly decoding the panels into tiles: 7x behind at one token, 3x ahead at a prefill's 512."""
    from types import SimpleNamespace

    ids = tactics.kernel_ids()
    vnni, amx, avx2 = ids["avx512_vnni"], ids["amx_bf16"], ids["avx2"]
    cost = {vnni: lambda m: 14 + 5 * m, amx: lambda m: 100 + 0.8 * m, avx2: lambda m: 60 * m}
    timed = []

    def fake_time(layer, m, kernels, x_dtype, budget_s=0.05, spread=None, weights=None):
        timed.append((m, sorted(kernels)))
        return {k: cost[k](m) for k in kernels}

    monkeypatch.setattr(tactics, "_time_us", fake_time)
    monkeypatch.setattr(tactics, "candidates", lambda *_: [vnni, amx, avx2])
    monkeypatch.setattr(tactics, "gemm_key", lambda *_: "n3072_k576_uint8_g64")
    layer = SimpleNamespace(weight=torch.empty(16, 8), scale=None, tactics=None)
    table = tactics.select({"mlp": layer}, torch.bfloat16, 512, True, tactics.TimingCache(None), log=lambda *_: None)
    winners = {row["m_max"]: row["kernel"] for row in table["n3072_k576_uint8_g64"]["buckets"]}
    assert winners[1] == "avx512_vnni" and winners[512] == "amx_bf16"
    assert all(avx2 not in kernels for m, kernels in timed if m >= 8) and all(amx in kernels for _, kernels in timed)


def test_timed_calls_are_the_models_own(monkeypatch):
    """Each timed call reads another layer's (or expert's) weights, as a decode step does, not one
    weight from the cache; experts are timed as the moe op runs them: fc with its activation fused,
    and on one thread each where a token's experts outnumber the threads twice over."""
    from types import SimpleNamespace

    from kiln.plugins import gemm

    seen = []

    def record(swiglu):
        def call(x, weight, scale, *args):
            seen.append((swiglu, weight.data_ptr(), scale.data_ptr(), torch.get_num_threads()))
        return call

    monkeypatch.setattr(gemm, "gemm", record(False))
    monkeypatch.setattr(gemm, "gemm_swiglu", record(True))
    kernel = tactics.kernel_ids()["avx2"]
    experts = [SimpleNamespace(weight=torch.randn(4, 3, 2, 2), scale=torch.randn(4, 3), bias=None, n=32, k=8,
                               group_size=0, out_float=False, swiglu=True, experts_per_token=top) for top in (2, 4)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tactics._time_us(experts[1], 1, [kernel], torch.float32, weights=tactics.operands(experts))
        assert {(swiglu, t) for swiglu, _, _, t in seen} == {(True, 1)}
        assert len({(w, s) for _, w, s, _ in seen}) == 8  # two layers' four experts, each in turn
        seen.clear()
        tactics._time_us(experts[0], 1, [kernel], torch.float32)
        assert {t for *_, t in seen} == {2} and len({w for _, w, _, _ in seen}) == 4
    finally:
        torch.set_num_threads(threads)
    dense = SimpleNamespace(weight=torch.randn(3, 2, 2), scale=None, bias=None, n=32, k=8, group_size=0,
                            out_float=False, swiglu=False)
    assert tactics.operands([dense, dense]) == [(dense.weight, None)] * 2
    assert tactics.gemm_key(experts[0], torch.bfloat16) == "n32_k8_float32_swiglu_experts2_xbfloat16"


def test_experts_never_take_atens_matmul(monkeypatch):
    """The moe op plans experts on its pool's threads, where ATen's matmul would start OpenMP teams of
    its own: expert GEMMs are not timed on it, and no bucket can pick it."""
    from types import SimpleNamespace

    ids = tactics.kernel_ids()
    timed = set()

    def fake_time(layer, m, kernels, x_dtype, budget_s=0.05, spread=None, weights=None):
        timed.update(kernels)
        return {k: 1.0 if k == tactics.ATEN else 2.0 for k in kernels}

    monkeypatch.setattr(tactics, "_time_us", fake_time)
    monkeypatch.setattr(tactics, "candidates", lambda *_: [ids["avx2"], tactics.ATEN])
    layer = SimpleNamespace(weight=torch.empty(2, 4, 16, 2), scale=None, bias=None, n=64, k=32, group_size=0,
                            out_float=False, swiglu=True, experts_per_token=2, tactics=None)
    table = tactics.select({"experts": layer}, torch.bfloat16, 64, False, tactics.TimingCache(None), log=lambda *_: None)
    assert tactics.ATEN not in timed and {row["kernel"] for e in table.values() for row in e["buckets"]} == {"avx2"}
