"""Checkpoints saved by transformers 4.57 and by 5.x, made from the real published configs of
Llama-3.2, Qwen2.5, Qwen3, Mistral, a YaRN-scaled Qwen2.5, Granite-3.1, OLMo-2, SmolLM3, Phi-3/3.5/4-mini,
Gemma 2/3 and the MoEs, convert to the same checkpoint and generate what HF generates (float32, greedy),
on the aoti and eager backends.

The 5.x side runs in another venv (KILN_TRANSFORMERS5_PYTHON, which `make test` sets): its
transformers saves the models and answers for them (tests/published_models.py). Without it, only
the installed transformers is the oracle. These models carry no tokenizer: the engines are loaded
with skip_tokenizer_init and given token ids.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

from conftest import TEST_BUILD
from kiln import LLM, SamplingParams
from kiln.build.builder import build_engine
from kiln.config import BuildConfig
from kiln.convert.cli import convert_checkpoint
from kiln.engine.loader import RankEngine
from published_models import NEW_TOKENS, PUBLISHED, read_oracle, write_oracle
from test_e2e import engine_logits

FAMILIES = list(PUBLISHED)
OWN = transformers.__version__
TRANSFORMERS5 = os.environ.get("KILN_TRANSFORMERS5_PYTHON") if OWN.startswith("4.") else None


@pytest.fixture(scope="module")
def oracles(tmp_path_factory) -> dict[str, dict[str, dict]]:
    """transformers version -> family -> what published_models.read_oracle gives."""
    root = tmp_path_factory.mktemp("published")
    dirs = {OWN: root / "own"}
    for name in FAMILIES:
        write_oracle(name, dirs[OWN])
    if TRANSFORMERS5:
        subprocess.run([TRANSFORMERS5, str(Path(__file__).with_name("published_models.py")), str(root / "tf5")],
                       check=True, timeout=900)
        dirs[read_oracle(root / "tf5", FAMILIES[0])["transformers"]] = root / "tf5"
    return {version: {name: read_oracle(d, name) for name in FAMILIES} for version, d in dirs.items()}


@pytest.fixture(scope="module")
def checkpoints(oracles, tmp_path_factory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("published_ckpt")
    return {version: {name: convert_checkpoint(o["model_dir"], root / version / name, dtype="float32")
                      for name, o in by_name.items()} for version, by_name in oracles.items()}


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory):
    """(family, backend) -> (engine dir, engine-build's summary line), built from the newest major's checkpoint."""
    newest = max(checkpoints, key=lambda v: tuple(map(int, v.split(".")[:2])))
    cache = {}

    def get(name, backend):
        if (name, backend) not in cache:
            lines = []
            # "triton": the GPU op set's Triton kernels, run in Triton's interpreter (an eager engine)
            build = dict(backend="eager", kernels="triton") if backend == "triton" else dict(backend=backend)
            out = build_engine(checkpoints[newest][name], tmp_path_factory.mktemp(f"{name}_{backend}") / "e",
                               BuildConfig(**{**TEST_BUILD, **build}), log=lines.append)
            cache[name, backend] = out, lines[-1]
        return cache[name, backend]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_both_majors_convert_to_the_same_checkpoint(name, oracles, checkpoints):
    if len(checkpoints) < 2:
        pytest.skip("needs both majors: transformers 4 here and KILN_TRANSFORMERS5_PYTHON for 5 (make test's first run)")
    (v4, a), (v5, b) = sorted((v, c[name]) for v, c in checkpoints.items())
    hf4, hf5 = (json.loads((oracles[v][name]["model_dir"] / "config.json").read_text()) for v in (v4, v5))
    assert "rope_theta" in hf4 and "rope_parameters" not in hf4, "transformers 4 writes the 4.x schema"
    assert "rope_parameters" in hf5 and "rope_theta" not in hf5, "transformers 5 writes the 5.x schema"
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir()) == [
        "config.json", "generation_config.json", "rank0.safetensors"]
    assert (a / "rank0.safetensors").read_bytes() == (b / "rank0.safetensors").read_bytes()
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    for v, d in ((v4, a), (v5, b)):  # copied as each transformers wrote it
        source = oracles[v][name]["model_dir"] / "generation_config.json"
        assert (d / "generation_config.json").read_bytes() == source.read_bytes()


# Every family eager, and compiled (aoti) once per architecture: qwen2.5-yarn and qwen2.5-swa are Qwen2's
# (mistral-v0.1 compiles the sliding window, phi4-mini LongRoPE); Mixtral's compiled engine is
# tests/test_moe.py's expert-parallel one. On the Triton kernels (in their interpreter): GQA with
# llama3 rope and tied embeddings, qkv bias, Gemma 2's window and soft cap with GeGLU, experts.
@pytest.mark.parametrize("name,backend", [(n, "eager") for n in FAMILIES] + [
    (n, "aoti") for n in FAMILIES if n not in ("qwen2.5", "mixtral", "qwen2.5-swa", "phi3.5")] + [
    (n, "triton") for n in ("llama3.2", "qwen2.5", "gemma2", "mixtral")])
def test_greedy_matches_hf(name, backend, oracles, engines, capsys):
    engine_dir, summary = engines(name, backend)
    assert "no tokenizer (none in" in summary, summary
    prompts = oracles[OWN][name]["prompts"]
    llm = LLM(engine_dir, skip_tokenizer_init=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert all(o.outputs[0].text == "" for o in outs)
    generated = [o.outputs[0].token_ids for o in outs]
    # Logits along the generated paths, all prompts prefilled in one step, against HF's per step. LongRoPE:
    # a step's logits come from its sequence's factors, short up to the switch and long past it.
    engine = RankEngine(engine_dir, max_tokens_in_paged_kv_cache=4096)
    switch = engine.config.pretrained_config.long_rope_threshold
    paths = [p + g for p, g in zip(prompts, generated)]
    long = engine_logits(engine, paths, switch + 1)
    short = engine_logits(engine, paths, 1) if switch else long
    ours = [torch.stack([(lg if len(p) + j > switch else sh)[len(p) - 1 + j] for j in range(NEW_TOKENS)])
            for p, sh, lg in zip(prompts, short, long)]
    for version, by_name in sorted(oracles.items()):
        oracle = by_name[name]
        assert oracle["prompts"] == prompts
        for i, (got, want) in enumerate(zip(generated, oracle["tokens"])):
            assert got == want, f"prompt {i} ({len(prompts[i])} tokens), transformers {version}"
        worst = max((o - ref).abs().max().item() for o, ref in zip(ours, oracle["logits"]))
        with capsys.disabled():
            print(f"\n[{name}/{backend}] transformers {version}: {len(prompts)} prompts x {NEW_TOKENS} "
                  f"tokens identical, max |logit - HF logit| = {worst:.2e}")
        assert worst < 1e-3
    distinct = {t for g in generated for t in g}
    assert len(distinct) > NEW_TOKENS, "greedy paths collapsed into repeats"
