"""HF -> unified checkpoint conversion: exact round trip through TP/PP shards, and clear errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kiln.config import ConfigError, PretrainedConfig
from kiln.convert.cli import convert_checkpoint, main
from kiln.convert.hf import CheckpointError
from kiln.convert.hf_config import pretrained_config_from_hf

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_key_value_heads=2,
            vocab_size=301, max_position_embeddings=256)


def _save(model, path: Path, **kw) -> Path:
    # HF initialises norms to ones and biases to zeros; random values make any mix-up visible.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.save_pretrained(path, safe_serialization=True, **kw)
    return path


def _build(kind: str, path: Path, **kw) -> Path:
    torch.manual_seed(0)
    if kind == "llama":  # GQA, tied embeddings, llama3 rope scaling, odd vocab (padded for TP)
        cfg = transformers.LlamaConfig(
            **TINY, num_attention_heads=4, tie_word_embeddings=True, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":  # 8 heads on 2 KV heads, untied
        cfg = transformers.MistralConfig(**TINY, num_attention_heads=8, sliding_window=None)
        model = transformers.MistralForCausalLM(cfg)
    elif kind == "qwen2":  # qkv bias on q/k/v (none on o_proj)
        cfg = transformers.Qwen2Config(**TINY, num_attention_heads=4, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":  # q/k RMSNorm, head_dim (32) != hidden / heads (16), bf16 weights
        cfg = transformers.Qwen3Config(**TINY, num_attention_heads=4, head_dim=32,
                                       tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    else:
        raise AssertionError(kind)
    return _save(model, path, **kw)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {k: _build(k, root / k) for k in ("llama", "mistral", "qwen2", "qwen3")}
    (dirs["llama"] / "tokenizer.json").write_text("{}")
    (dirs["llama"] / "tokenizer_config.json").write_text("{}")
    return dirs


def hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def reassemble(ckpt: Path) -> dict[str, torch.Tensor]:
    """Undo the TP/PP sharding of a checkpoint, giving back HF-named tensors.

    Written from the format's definition, independently of kiln.convert.shard.
    """
    cfg = json.loads((ckpt / "config.json").read_text())
    tp, pp = cfg["mapping"]["tp_size"], cfg["mapping"]["pp_size"]
    assert cfg["mapping"]["world_size"] == tp * pp
    assert sorted(p.name for p in ckpt.glob("rank*.safetensors")) == sorted(
        f"rank{r}.safetensors" for r in range(tp * pp))
    ranks = [load_file(ckpt / f"rank{r}.safetensors") for r in range(tp * pp)]
    stage = [[ranks[s * tp + t] for t in range(tp)] for s in range(pp)]
    vocab, hd = cfg["vocab_size"], cfg["head_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = {}

    def vocab_table(shards):
        full = torch.cat(shards, 0)
        assert full.shape[0] % tp == 0 and full.shape[0] - vocab < tp
        assert not full[vocab:].any(), "vocab padding rows must be zero"
        return full[:vocab]

    # Every tensor lives on exactly the pipeline stage that owns it.
    owners = {}
    for s, files in enumerate(stage):
        names = set(files[0])
        assert all(set(f) == names for f in files), "tp ranks of a stage hold the same names"
        for n in names:
            owners.setdefault(n, set()).add(s)
    assert all(len(v) == 1 for v in owners.values())
    assert owners.pop("transformer.vocab_embedding.weight") == {0}
    assert owners.pop("transformer.ln_f.weight") == owners.pop("lm_head.weight") == {pp - 1}
    layer_stage = {int(n.split(".")[2]): next(iter(s)) for n, s in owners.items()}
    assert sorted(layer_stage) == list(range(cfg["num_hidden_layers"]))
    by_layer = [layer_stage[i] for i in sorted(layer_stage)]
    assert by_layer == sorted(by_layer), "stages hold consecutive layers"

    out["model.embed_tokens.weight"] = vocab_table([f["transformer.vocab_embedding.weight"] for f in stage[0]])
    out["model.norm.weight"] = stage[-1][0]["transformer.ln_f.weight"]
    out["lm_head.weight"] = vocab_table([f["lm_head.weight"] for f in stage[-1]])
    for i, s in sorted(layer_stage.items()):
        files = stage[s]
        t, h = f"transformer.layers.{i}.", f"model.layers.{i}."

        def cat(name, dim):
            return torch.cat([f[t + name] for f in files], dim)

        def replicated(name):
            assert all(torch.equal(f[t + name], files[0][t + name]) for f in files)
            return files[0][t + name]

        for kind in ("weight", "bias") if t + "attention.qkv.bias" in files[0] else ("weight",):
            q_rows, kv_rows = heads // tp * hd, max(1, kv // tp) * hd
            parts = [f[t + f"attention.qkv.{kind}"] for f in files]
            assert all(p.shape[0] == q_rows + 2 * kv_rows for p in parts)
            out[h + f"self_attn.q_proj.{kind}"] = torch.cat([p[:q_rows] for p in parts])
            for j, proj in ((0, "k_proj"), (1, "v_proj")):
                pieces = [p[q_rows + j * kv_rows: q_rows + (j + 1) * kv_rows] for p in parts]
                if tp > kv:  # each KV head is copied onto tp // kv consecutive ranks
                    group = tp // kv
                    for r, piece in enumerate(pieces):
                        assert torch.equal(piece, pieces[r - r % group])
                    pieces = pieces[::group]
                out[h + f"self_attn.{proj}.{kind}"] = torch.cat(pieces)
        out[h + "self_attn.o_proj.weight"] = cat("attention.dense.weight", 1)
        out[h + "mlp.gate_proj.weight"] = cat("mlp.fc.weight", 0)
        out[h + "mlp.up_proj.weight"] = cat("mlp.gate.weight", 0)
        out[h + "mlp.down_proj.weight"] = cat("mlp.proj.weight", 1)
        out[h + "input_layernorm.weight"] = replicated("input_layernorm.weight")
        out[h + "post_attention_layernorm.weight"] = replicated("post_layernorm.weight")
        if t + "attention.q_layernorm.weight" in files[0]:
            out[h + "self_attn.q_norm.weight"] = replicated("attention.q_layernorm.weight")
            out[h + "self_attn.k_norm.weight"] = replicated("attention.k_layernorm.weight")
    return out


EXPECTED = {
    "llama": dict(architecture="LlamaForCausalLM", num_attention_heads=4, head_size=16,
                  tie_word_embeddings=True, attn_bias=False, qk_layernorm=False, rotary_base=500000.0,
                  rotary_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  dtype="float32"),
    "mistral": dict(architecture="MistralForCausalLM", num_attention_heads=8, head_size=8,
                    tie_word_embeddings=False, rotary_scaling=None, dtype="float32"),
    "qwen2": dict(architecture="Qwen2ForCausalLM", attn_bias=True, qk_layernorm=False, head_size=16,
                  tie_word_embeddings=False),
    "qwen3": dict(architecture="Qwen3ForCausalLM", attn_bias=False, qk_layernorm=True, head_size=32,
                  tie_word_embeddings=True, dtype="bfloat16"),
}


@pytest.mark.parametrize("kind,tp,pp", [
    ("llama", 1, 1), ("llama", 2, 2), ("llama", 4, 1),  # tp 4 > 2 KV heads: replicated
    ("mistral", 2, 1), ("qwen2", 4, 2), ("qwen3", 2, 1), ("qwen3", 1, 2),
])
def test_round_trip(hf_dirs, tmp_path, kind, tp, pp):
    src = hf_dirs[kind]
    out = convert_checkpoint(src, tmp_path / "ckpt", tp_size=tp, pp_size=pp)
    assert out == tmp_path / "ckpt"

    state = hf_state(src)
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    got = reassemble(out)
    assert set(got) == set(state)
    for name, want in state.items():
        assert got[name].dtype == want.dtype, name
        assert torch.equal(got[name], want), name

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mapping"] == {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "moe_tp_size": tp, "moe_ep_size": 1}
    for key, value in {**TINY, **EXPECTED[kind]}.items():
        assert key in cfg, key
        assert cfg[key] == value, key
    assert cfg["num_key_value_heads"] == 2 and cfg["norm_epsilon"] == 1e-6
    assert cfg["quantization"]["quant_algo"] is None
    assert PretrainedConfig.load(out).mapping.world_size == tp * pp
    assert not list(tmp_path.glob(".*")), "no staging dirs left behind"


def test_dtype_cast_and_tokenizer_files(hf_dirs, tmp_path):
    out = convert_checkpoint(hf_dirs["llama"], tmp_path / "c", dtype="bfloat16", tp_size=2)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    rank1 = load_file(out / "rank1.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in rank1.values())
    want = hf_state(hf_dirs["llama"])["model.embed_tokens.weight"][151:].to(torch.bfloat16)
    assert torch.equal(rank1["transformer.vocab_embedding.weight"][:150], want)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (hf_dirs["llama"] / name).read_bytes(), name


def test_sharded_hf_checkpoint_converts_the_same(hf_dirs, tmp_path):
    sharded = _build("llama", tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    a = convert_checkpoint(hf_dirs["llama"], tmp_path / "a", tp_size=2, pp_size=2)
    b = convert_checkpoint(sharded, tmp_path / "b", tp_size=2, pp_size=2)
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    for r in range(4):
        ta, tb = load_file(a / f"rank{r}.safetensors"), load_file(b / f"rank{r}.safetensors")
        assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_replaces_existing_checkpoint_only_when_complete(hf_dirs, tmp_path, monkeypatch):
    out = convert_checkpoint(hf_dirs["llama"], tmp_path / "c", tp_size=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    import kiln.convert.writer as writer

    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "copy_tokenizer_files", fail)
    with pytest.raises(OSError):
        convert_checkpoint(hf_dirs["llama"], out, tp_size=2)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]

    monkeypatch.undo()
    convert_checkpoint(hf_dirs["llama"], out, tp_size=2)
    assert sorted(p.name for p in out.glob("rank*")) == ["rank0.safetensors", "rank1.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_refuses_to_replace_a_foreign_dir(hf_dirs, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        convert_checkpoint(hf_dirs["llama"], tmp_path / "notes")
    with pytest.raises(CheckpointError, match="would replace the model dir"):
        convert_checkpoint(hf_dirs["llama"], hf_dirs["llama"])
    assert (tmp_path / "notes" / "a.txt").read_text() == "keep me"


@pytest.mark.parametrize("scaling,want", [
    ({"type": "linear", "factor": 2.0}, {"type": "linear", "factor": 2.0}),
    ({"rope_type": "dynamic", "factor": 4.0}, {"type": "dynamic", "factor": 4.0}),
    ({"rope_type": "default"}, None),
])
def test_rope_scaling_types(scaling, want):
    hf = transformers.LlamaConfig(**TINY, num_attention_heads=4, rope_scaling=scaling).to_dict()
    hf["architectures"] = ["LlamaForCausalLM"]
    assert pretrained_config_from_hf(hf).rotary_scaling == want


def test_sliding_window_where_hf_applies_it():
    # Qwen2/Qwen3 hub configs carry a sliding_window that only use_sliding_window switches on, and
    # then only on the layers from max_window_layers on (or those layer_types marks).
    def qwen2(**kw):
        cfg = transformers.Qwen2Config(**TINY, num_attention_heads=4, sliding_window=32, **kw)
        return cfg, dict(cfg.to_dict(), architectures=["Qwen2ForCausalLM"])

    for kw in (dict(use_sliding_window=False), dict(use_sliding_window=True, max_window_layers=3)):
        cfg, hf = qwen2(**kw)
        assert "sliding_attention" not in cfg.layer_types
        assert pretrained_config_from_hf(hf).attn_bias
        assert pretrained_config_from_hf(hf).sliding_window is None
    cfg, hf = qwen2(use_sliding_window=True, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    ours = pretrained_config_from_hf(hf)
    assert (ours.sliding_window, ours.sliding_window_layers, ours.kv_window) == (32, [1, 2], 0)
    del hf["layer_types"]  # as a 4.x-era config.json has it: derived from max_window_layers
    assert pretrained_config_from_hf(hf).sliding_window_layers == [1, 2]


# ---------------------------------------------------------------------------------------------
# bad input: one clear line, exit 1, nothing at the output location


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _missing_safetensors(d, tmp):
    d = _copy(d["llama"], tmp / "m")
    (d / "model.safetensors").unlink()
    return d, [], "no model.safetensors"


def _pickle_only(d, tmp):
    d, _, _ = _missing_safetensors(d, tmp)
    (d / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    return d, [], "only pickle weights (pytorch_model.bin)"


def _truncated(d, tmp):
    d = _copy(d["llama"], tmp / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    return d, [], "model.safetensors is not a readable safetensors file"


def _missing_shard(d, tmp):
    d = _build("llama", tmp / "m", max_shard_size="40KB")
    next(d.glob("model-00002-*.safetensors")).unlink()
    return d, [], "listed in model.safetensors.index.json not found"


def _missing_tensor(d, tmp):
    d = _copy(d["qwen2"], tmp / "m")
    state = load_file(d / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.bias"]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    return d, [], "tensor 'model.layers.1.self_attn.k_proj.bias' not found in"


def _shape_mismatch(d, tmp):
    d = _copy(d["mistral"], tmp / "m")
    state = load_file(d / "model.safetensors")
    state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    return d, [], "'model.layers.2.mlp.up_proj.weight' in "


def _unsupported_arch(d, tmp):
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    d = _save(transformers.GPT2LMHeadModel(cfg), tmp / "m")
    return d, [], "architecture 'GPT2LMHeadModel' is not supported; expected one of LlamaForCausalLM"


def _tp_not_dividing_heads(d, tmp):
    return d["llama"], ["--tp_size", "3"], "tp_size 3 does not divide num_attention_heads (4)"


def _sliding_window(d, tmp):
    d = _copy(d["mistral"], tmp / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["sliding_window"] = 0
    (d / "config.json").write_text(json.dumps(cfg))
    return d, [], "sliding_window 0 is not supported; expected an integer >= 1"


@pytest.mark.parametrize("make", [
    _missing_safetensors, _pickle_only, _truncated, _missing_shard, _missing_tensor,
    _shape_mismatch, _unsupported_arch, _tp_not_dividing_heads, _sliding_window,
], ids=lambda f: f.__name__.strip("_"))
def test_bad_input(hf_dirs, tmp_path, make):
    model_dir, args, message = make(hf_dirs, tmp_path)
    out = tmp_path / "out" / "ckpt"

    with pytest.raises(ConfigError) as err:
        convert_checkpoint(model_dir, out, tp_size=int(args[1]) if args else 1)
    assert message in str(err.value) and "\n" not in str(err.value)

    result = CliRunner().invoke(main, ["--model_dir", str(model_dir), "--output_dir", str(out), *args])
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out").exists(), "nothing may be left at the output location"
    if "shape" in make.__name__:
        assert "has shape [95, 64], expected [96, 64]" in result.stderr


def test_cli_success_summary(hf_dirs, tmp_path):
    result = CliRunner().invoke(main, ["--model_dir", str(hf_dirs["qwen2"]), "--output_dir",
                                       str(tmp_path / "c"), "--tp_size", "2", "--dtype", "float16"])
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert line.startswith("converted Qwen2ForCausalLM in ") and "\n" not in line
    assert "2 rank file(s)" in line and "peak RSS" in line and line.endswith(f"-> {tmp_path / 'c'}")
    help_text = CliRunner().invoke(main, ["--help"]).stdout
    for flag in ("--model_dir", "--output_dir", "--dtype", "--tp_size", "--pp_size"):
        assert flag in help_text


@pytest.mark.parametrize("kind,tp", [("llama", 2), ("llama", 4), ("qwen2", 4)])
def test_shard_tensor_splits_a_whole_checkpoint_as_the_converter_does(hf_dirs, tmp_path, kind, tp):
    """kiln.convert.shard.shard_tensor (which splits quantized checkpoints) cuts the tensors of a tp 1
    checkpoint exactly as the converter writes tp ranks: odd vocab padded, KV heads replicated at tp 4."""
    from kiln.convert.shard import shard_tensor

    whole = load_file(convert_checkpoint(hf_dirs[kind], tmp_path / "whole") / "rank0.safetensors")
    out = convert_checkpoint(hf_dirs[kind], tmp_path / "sharded", tp_size=tp)
    cfg = PretrainedConfig.load(out)
    for rank in range(tp):
        want = load_file(out / f"rank{rank}.safetensors")
        assert set(want) == set(whole)
        for name, t in whole.items():
            assert torch.equal(shard_tensor(cfg, name, t, rank), want[name]), (rank, name)
