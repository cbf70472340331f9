"""Quantized checkpoints (convert_checkpoint --qformat/--kv_cache_dtype): the exact TensorRT-LLM
tensor layout of every format, weights that dequantize back near the originals, calibrated
methods that beat round-to-nearest, the accuracy report, and clear errors on bad input."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from kiln.build.builder import build_engine
from kiln.config import BuildConfig, ConfigError, PretrainedConfig
from kiln.convert.cli import convert_checkpoint, main
from kiln.convert.quantize.calib import make_split
from kiln.convert.quantize.pipeline import QuantOptions
from kiln.convert.quantize.rtn import (dequantize_linear, int4_per_group, int8_per_channel, pack_int4,
                                       unpack_int4)
from kiln.engine.loader import RankEngine

from conftest import MODELOPT, TEST_BUILD, require  # noqa: E402

require(*MODELOPT, module_level=True)
from test_e2e import engine_logits  # noqa: E402
from tiny_models import corpus  # noqa: E402

GROUP = 32  # divides every tiny model's linear inputs (64 and 128)
LINEARS = {"attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "attention.dense": ("self_attn.o_proj",), "mlp.fc": ("mlp.gate_proj",),
           "mlp.gate": ("mlp.up_proj",), "mlp.proj": ("mlp.down_proj",)}
ALGO = {"fp8": "FP8", "int8_wo": "W8A16", "int4_wo": "W4A16", "int4_awq": "W4A16_AWQ",
        "int4_gptq": "W4A16_GPTQ", "w4a8_awq": "W4A8_AWQ", "int8_sq": "W8A8_SQ_PER_CHANNEL"}
CONSOLE_SCRIPT = Path(sys.executable).parent / "convert_checkpoint"


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n\n".join(corpus()))
    return path


def opts(qformat=None, kv=None, calib=None, **kw) -> QuantOptions:
    kw = {"group_size": GROUP, "calib_size": 8, "calib_max_seq_len": 64, "eval_size": 8, **kw}
    return QuantOptions(qformat, kv, calib_dataset=calib, **kw)


def load_ckpt(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(ckpt.glob("rank*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in load_file(model_dir / "model.safetensors").items()}


def original(hf: dict, layer: int, name: str) -> torch.Tensor:
    return torch.cat([hf[f"model.layers.{layer}.{p}.weight"] for p in LINEARS[name]])


def linear_parts(tensors: dict, layer: int, name: str) -> dict[str, torch.Tensor]:
    prefix = f"transformer.layers.{layer}.{name}."
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def writes_pqs(qformat: str | None, awq_algorithm: str = "clip") -> bool:
    """Linears carry prequant_scaling_factor: AWQ's smoothing scales (not awq_clip's), SmoothQuant's."""
    return qformat in ("w4a8_awq", "int8_sq") or (qformat == "int4_awq" and awq_algorithm != "clip")


def expected_layout(cfg: dict, qformat: str | None, kv: str | None, awq_algorithm: str = "clip") -> dict[str, tuple]:
    """name -> (dtype, shape) of every tensor of a tp=1 checkpoint, from the format's definition."""
    dt = getattr(torch, cfg["dtype"])
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_size"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"attention.qkv": (q_out + 2 * kv_out, h), "attention.dense": (h, q_out),
              "mlp.fc": (inter, h), "mlp.gate": (inter, h), "mlp.proj": (h, inter)}
    f32 = torch.float32
    out = {"transformer.vocab_embedding.weight": (dt, (cfg["vocab_size"], h)),
           "lm_head.weight": (dt, (cfg["vocab_size"], h)), "transformer.ln_f.weight": (dt, (h,))}
    for i in range(cfg["num_hidden_layers"]):
        layer = f"transformer.layers.{i}."
        out[layer + "input_layernorm.weight"] = out[layer + "post_layernorm.weight"] = (dt, (h,))
        if cfg["attn_bias"]:
            out[layer + "attention.qkv.bias"] = (dt, (q_out + 2 * kv_out,))
        if cfg["qk_layernorm"]:
            out[layer + "attention.q_layernorm.weight"] = out[layer + "attention.k_layernorm.weight"] = (dt, (hd,))
        if kv:
            for s in ("kv", "k", "v"):
                out[layer + f"attention.{s}_cache_scaling_factor"] = (f32, (1,))
        for name, (o, n) in shapes.items():
            p = layer + name + "."
            if qformat is None:
                out[p + "weight"] = (dt, (o, n))
            elif qformat == "fp8":
                out.update({p + "weight": (torch.float8_e4m3fn, (o, n)), p + "weights_scaling_factor": (f32, (1,)),
                            p + "activation_scaling_factor": (f32, (1,))})
            elif qformat in ("int8_wo", "int8_sq"):
                out.update({p + "weight": (torch.int8, (o, n)), p + "weights_scaling_factor": (f32, (o,))})
            else:  # int4, packed two output rows per byte
                out.update({p + "weight": (torch.int8, (o // 2, n)),
                            p + "weights_scaling_factor": (f32, (o, n // GROUP))})
            if writes_pqs(qformat, awq_algorithm):
                out[p + "prequant_scaling_factor"] = (dt, (n,))
            if qformat in ("w4a8_awq", "int8_sq"):
                out[p + "activation_scaling_factor"] = (f32, (1,))
            if qformat == "w4a8_awq":
                out[p + "weights_scaling_factor_2"] = (f32, (1,))
    return out


# ---------------------------------------------------------------------------------------------
# round-to-nearest and the int4 packing


def test_int4_packing_matches_modelopt_and_round_trips():
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    torch.manual_seed(0)
    w = torch.randn(48, 96)
    q, scale = int4_per_group(w, 32)
    assert q.min() >= -8 and q.max() <= 7
    ours = pack_int4(q)
    theirs = pack_int4_in_uint8(w, scale, 32).view(torch.int8)
    assert ours.shape == (24, 96) and torch.equal(ours, theirs)
    assert torch.equal(unpack_int4(ours), q)
    # byte[o2, i] = (q[2*o2, i] & 0xF) | (q[2*o2+1, i] << 4), spelled out for one byte
    b = int(ours[3, 5]) & 0xFF
    assert b == (int(q[6, 5]) & 0xF) | ((int(q[7, 5]) & 0xF) << 4)


@pytest.mark.parametrize("algo", ["W8A16", "W4A16"])
def test_rtn_error_is_at_most_half_a_step(algo):
    torch.manual_seed(1)
    w = torch.randn(64, 128) * torch.rand(64, 1) * 3  # rows of different ranges
    w[5] = 0  # an all-zero row must not divide by zero
    if algo == "W8A16":
        q, scale = int8_per_channel(w)
        step = scale[:, None].expand_as(w)
        parts = {"weight": q, "weights_scaling_factor": scale}
    else:
        q, scale = int4_per_group(w, GROUP)
        step = scale.repeat_interleave(GROUP, 1)
        parts = {"weight": pack_int4(q), "weights_scaling_factor": scale}
    deq = dequantize_linear(parts, algo, GROUP)
    assert torch.all((deq - w).abs() <= step / 2 + 1e-6)
    assert torch.equal(deq[5], torch.zeros(128))


# ---------------------------------------------------------------------------------------------
# every format: layout, config, dequantized weights, report

# Relative Frobenius error of the dequantized weights (pre-quant scales folded back in).
WEIGHT_ERROR = {"int8_wo": 0.01, "int8_sq": 0.02, "fp8": 0.05, "int4_wo": 0.12, "int4_awq": 0.15,
                "int4_gptq": 0.2, "w4a8_awq": 0.15}


@pytest.mark.parametrize("qformat,kv", [
    ("int8_wo", None), ("int4_wo", None), ("fp8", "fp8"), ("int4_awq", None), ("int4_gptq", None),
    ("w4a8_awq", "fp8"), ("int8_sq", "int8"), ("int8_wo", "int8"), (None, "fp8"),
])
def test_format_layout_and_report(hf_model, calib_file, tmp_path, qformat, kv):
    src = hf_model("llama")  # tied embeddings, GQA
    calibrated = kv is not None or qformat not in ("int8_wo", "int4_wo")
    # Round-to-nearest without KV needs no calibration; it still gets a report from held-out text.
    o = opts(qformat, kv, calib_file) if calibrated else opts(qformat, kv, eval_dataset=calib_file)
    out = convert_checkpoint(src, tmp_path / "ckpt", quant=o)

    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization"]
    assert q["quant_algo"] == ALGO.get(qformat)
    assert q["kv_cache_quant_algo"] == {"fp8": "FP8", "int8": "INT8", None: None}[kv]
    if qformat:
        assert q["exclude_modules"] == ["lm_head"] and q["has_zero_point"] is False
        assert q["pre_quant_scale"] == writes_pqs(qformat)
        if qformat.startswith(("int4", "w4a8")):
            assert q["group_size"] == GROUP
    assert cfg["tie_word_embeddings"] and cfg["rotary_scaling"]["type"] == "llama3"
    PretrainedConfig.load(out)  # the engine side's reader accepts it

    tensors = load_ckpt(out)
    want = expected_layout(cfg, qformat, kv)
    assert set(tensors) == set(want)
    for name, (dtype, shape) in want.items():
        assert (tensors[name].dtype, tuple(tensors[name].shape)) == (dtype, shape), name

    hf = hf_weights(src)
    assert torch.equal(tensors["lm_head.weight"], tensors["transformer.vocab_embedding.weight"])
    assert torch.equal(tensors["transformer.layers.1.input_layernorm.weight"],
                       hf["model.layers.1.input_layernorm.weight"])
    for i in range(cfg["num_hidden_layers"]):
        if kv:
            scale = tensors[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]
            assert scale.item() > 0
        for name in LINEARS:
            w = original(hf, i, name)
            parts = linear_parts(tensors, i, name)
            deq = dequantize_linear(parts, q["quant_algo"], GROUP) if qformat else parts["weight"].float()
            err = ((deq - w).norm() / w.norm()).item()
            assert err < WEIGHT_ERROR.get(qformat, 1e-6), (name, i, err)

    report = json.loads((out / "quant_report.json").read_text())
    assert report["qformat"] == qformat and report["quant_algo"] == q["quant_algo"]
    assert report["eval_windows"] == 8 and report["eval_tokens"] == 8 * 64
    assert ("--eval_dataset" in report["eval_source"]) != calibrated
    ratio = report["perplexity_quant"] / report["perplexity_ref"]
    assert report["perplexity_increase_pct"] == pytest.approx(100 * (ratio - 1))
    # The report's numbers, computed again another way: HF for the reference, the checkpoint's own
    # eager engine for the quantized model (its kernels really quantize activations and the KV
    # cache), by this test's code, on the same held-out windows.
    from transformers import AutoTokenizer

    calib_text = [calib_file.read_text()]
    split = make_split(AutoTokenizer.from_pretrained(src), calib_text if calibrated else None,
                       None if calibrated else calib_text, o.calib_size, o.calib_max_seq_len, o.eval_size)
    assert len(split.eval) == report["eval_windows"]
    build = BuildConfig(**{**TEST_BUILD, "max_num_tokens": 1024}, backend="eager")  # every window in one step
    engine_dir = build_engine(out, tmp_path / "engine", build, log=lambda *_: None)
    theirs = independent_report(src, engine_dir, [w.tolist() for w in split.eval])
    assert theirs["eval_tokens"] == report["eval_tokens"]
    assert report["perplexity_ref"] == pytest.approx(theirs["perplexity_ref"], rel=1e-5)
    assert report["perplexity_quant"] == pytest.approx(theirs["perplexity_quant"], rel=REPORT_TOL["perplexity"])
    assert report["kl_divergence_mean"] == pytest.approx(theirs["kl_divergence_mean"], rel=REPORT_TOL["kl"], abs=1e-7)
    assert abs(report["top1_agreement"] - theirs["top1_agreement"]) * report["eval_tokens"] <= REPORT_TOL["top1_tokens"]
    assert not list(tmp_path.glob(".*")), "no staging dirs left behind"


# The float32 engine against the report's fake-quant model: the same quantized model with the
# arithmetic in another order, except where an activation sits on a rounding boundary of its
# 8-bit grid and flips one step. Measured worst over the formats above: perplexity 6.5e-5
# relative (int8_sq), mean KL 5.4e-4 relative and top-1 one token of 512 (w4a8_awq).
REPORT_TOL = {"perplexity": 3e-4, "kl": 3e-3, "top1_tokens": 3}


def independent_report(hf_dir: Path, engine_dir: Path, windows: list[list[int]]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    quant = engine_logits(RankEngine(engine_dir, max_tokens_in_paged_kv_cache=4096), windows)
    nll_ref = nll_quant = kl = 0.0
    agree = count = 0
    for w, q in zip(windows, quant, strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([w])).logits[0]
        ref, q = torch.log_softmax(ref[:-1].double(), -1), torch.log_softmax(q[:-1].double(), -1)
        nxt = torch.tensor(w[1:])
        nll_ref -= ref[torch.arange(len(nxt)), nxt].sum().item()
        nll_quant -= q[torch.arange(len(nxt)), nxt].sum().item()
        kl += torch.nn.functional.kl_div(q, ref, log_target=True, reduction="sum").item()
        agree += (ref.argmax(-1) == q.argmax(-1)).sum().item()
        count += len(nxt)
    return {"perplexity_ref": math.exp(nll_ref / count), "perplexity_quant": math.exp(nll_quant / count),
            "kl_divergence_mean": kl / count, "top1_agreement": agree / count, "eval_tokens": count}


# ---------------------------------------------------------------------------------------------
# calibrated methods against round-to-nearest


def _linear_inputs(model_dir: Path, text: Path, windows: int = 16, seq_len: int = 64) -> dict:
    """The inputs each checkpoint linear sees in the unquantized model, [tokens, in] per layer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.convert.quantize.calib import token_stream

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = token_stream(AutoTokenizer.from_pretrained(model_dir), [text.read_text()])
    batch = ids[: windows * seq_len].reshape(windows, seq_len)
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        for name, hf_names in LINEARS.items():
            def hook(_, args, key=(i, name)):
                seen[key] = args[0].reshape(-1, args[0].shape[-1])
            hooks.append(layer.get_submodule(hf_names[0]).register_forward_pre_hook(hook))
    with torch.no_grad():
        model(input_ids=batch)
    for h in hooks:
        h.remove()
    return seen


def _output_error(tensors: dict, algo: str, hf: dict, inputs: dict) -> float:
    """Sum over linears of ||X W_q^T - X W^T||^2 / ||X W^T||^2."""
    total = 0.0
    for (i, name), x in inputs.items():
        w = original(hf, i, name)
        deq = dequantize_linear(linear_parts(tensors, i, name), algo, GROUP)
        total += ((x @ (deq - w).T).norm() ** 2 / (x @ w.T).norm() ** 2).item()
    return total


def test_awq_and_gptq_beat_round_to_nearest(hf_model, calib_file, tmp_path):
    src = hf_model("mistral")
    inputs = _linear_inputs(src, calib_file)
    hf = hf_weights(src)
    errors = {}
    for qformat in ("int4_wo", "int4_awq", "int4_gptq"):
        out = convert_checkpoint(src, tmp_path / qformat, quant=opts(qformat, None, calib_file, calib_size=16,
                                                                      eval_size=2))
        errors[qformat] = _output_error(load_ckpt(out), ALGO[qformat], hf, inputs)
    assert errors["int4_gptq"] < 0.9 * errors["int4_wo"], errors
    assert errors["int4_awq"] < errors["int4_wo"], errors


@pytest.mark.parametrize("awq_algorithm", ["clip", "lite", "full"])
def test_awq_algorithms_checkpoint_loads_for_the_engine(hf_model, calib_file, tmp_path, awq_algorithm):
    # ModelOpt's awq_clip export has no pre-quant scales but says pre_quant_scale: true; ours
    # must say false, or engine-build asks for tensors that are not there.
    from kiln.build.weights import load_rank_weights
    from kiln.models.llama import checkpoint_tensors

    out = convert_checkpoint(hf_model("llama"), tmp_path / "c", quant=opts(
        "int4_awq", None, calib_file, calib_size=4, eval_size=2, awq_algorithm=awq_algorithm))
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["quantization"]["pre_quant_scale"] == (awq_algorithm != "clip")
    tensors = load_ckpt(out)
    assert set(tensors) == set(expected_layout(cfg_json, "int4_awq", None, awq_algorithm))
    cfg = PretrainedConfig.load(out)
    assert set(checkpoint_tensors(cfg, 0)) == set(tensors)
    weights = load_rank_weights(out, cfg, 0)
    assert any(k.endswith("prequant_scaling_factor") for k in weights) == (awq_algorithm != "clip")
    report = json.loads((out / "quant_report.json").read_text())
    assert report["method"] == f"ModelOpt INT4_AWQ_CFG (awq_{awq_algorithm})"


def test_awq_algorithm_option(hf_model, calib_file, tmp_path):
    result = CliRunner().invoke(main, [
        "--model_dir", str(hf_model("llama")), "--output_dir", str(tmp_path / "c"), "--qformat", "int4_awq",
        "--awq_algorithm", "magic", "--calib_dataset", str(calib_file)])
    assert result.exit_code == 2 and "'magic' is not one of 'lite', 'clip', 'full'" in result.output
    with pytest.raises(ConfigError, match="--awq_algorithm 'magic' is not supported"):
        convert_checkpoint(hf_model("llama"), tmp_path / "c", quant=opts("int4_awq", None, calib_file,
                                                                         awq_algorithm="magic"))
    assert not (tmp_path / "c").exists()


def test_round_to_nearest_matches_modelopt(hf_model, calib_file, tmp_path):
    # int4_wo alone is ours; with a KV cache format it goes through ModelOpt's max-calibrated
    # int4 preset. Both must be the same weights.
    src = hf_model("llama")
    ours = load_ckpt(convert_checkpoint(src, tmp_path / "rtn", quant=opts("int4_wo")))
    theirs = load_ckpt(convert_checkpoint(src, tmp_path / "mo", quant=opts("int4_wo", "fp8", calib_file)))
    for name, t in ours.items():
        if "scaling_factor" in name:
            torch.testing.assert_close(t, theirs[name], rtol=1e-3, atol=0, msg=name)
        elif name.endswith(".weight") and t.dtype == torch.int8:
            # ModelOpt quantizes the fp16 copy it exports; a value on a rounding boundary may differ.
            assert (unpack_int4(t) != unpack_int4(theirs[name])).float().mean() < 0.002, name
        else:
            assert torch.equal(t, theirs[name]), name


# ---------------------------------------------------------------------------------------------
# model families, pipeline parallelism, the CLI


@pytest.mark.parametrize("family,qformat", [("qwen2", "int4_awq"), ("qwen3", "fp8")])
def test_family_tensors_survive(hf_model, calib_file, tmp_path, family, qformat):
    src = hf_model(family)
    plain = load_ckpt(convert_checkpoint(src, tmp_path / "plain"))
    out = convert_checkpoint(src, tmp_path / "q", quant=opts(qformat, "int8", calib_file))
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_ckpt(out)
    want = expected_layout(cfg, qformat, "int8")
    assert set(tensors) == set(want)
    extra = "attention.qkv.bias" if family == "qwen2" else "attention.q_layernorm.weight"
    assert cfg["attn_bias"] == (family == "qwen2") and cfg["qk_layernorm"] == (family == "qwen3")
    kept = [n for n in plain if not n.endswith(tuple(f"{p}.weight" for p in LINEARS))]
    assert any(n.endswith(extra) for n in kept)
    for name in kept:  # biases, norms, q/k norms, embedding and lm_head as the plain conversion
        assert torch.equal(tensors[name], plain[name]), name


def test_pipeline_parallel_split(hf_model, tmp_path):
    src = hf_model("llama")
    whole = load_ckpt(convert_checkpoint(src, tmp_path / "pp1", quant=opts("int4_wo")))
    out = convert_checkpoint(src, tmp_path / "pp2", pp_size=2, quant=opts("int4_wo"))
    r0, r1 = load_file(out / "rank0.safetensors"), load_file(out / "rank1.safetensors")
    assert not set(r0) & set(r1) and set(r0) | set(r1) == set(whole)
    assert "transformer.vocab_embedding.weight" in r0 and "lm_head.weight" in r1
    assert all(".layers.0." in n for n in r0 if ".layers." in n)
    assert all(".layers.1." in n for n in r1 if ".layers." in n)
    assert all(torch.equal(whole[n], t) for n, t in {**r0, **r1}.items())
    assert json.loads((out / "config.json").read_text())["mapping"]["pp_size"] == 2


def test_cli_prints_report_then_summary(hf_model, calib_file, tmp_path):
    result = CliRunner().invoke(main, [
        "--model_dir", str(hf_model("qwen2")), "--output_dir", str(tmp_path / "c"), "--qformat", "int8_wo",
        "--eval_dataset", str(calib_file), "--calib_max_seq_len", "64", "--eval_size", "4"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("accuracy of int8_wo (W8A16/-) on 256 tokens, --eval_dataset")
    assert "perplexity" in lines[1] and "mean KL" in lines[1] and "top-1 agreement" in lines[1]
    assert lines[-1].startswith("converted Qwen2ForCausalLM in ") and len(lines) == 3
    report = json.loads((tmp_path / "c" / "quant_report.json").read_text())
    assert f"{report['perplexity_quant']:.3f}" in lines[1]


def test_unsupported_modelopt_quant_algo(hf_model, tmp_path):
    import modelopt.torch.quantization as mtq
    from transformers import AutoModelForCausalLM

    from kiln.convert.quantize.modelopt import export, modelopt_config, quiet, read_export

    model = AutoModelForCausalLM.from_pretrained(hf_model("llama"), dtype=torch.float32).eval()
    with quiet():
        mtq.quantize(model, modelopt_config("int8_wo", None, GROUP), lambda m: m(torch.arange(32)[None]))
    export(model, "LlamaForCausalLM", "float16", tmp_path)
    assert read_export(tmp_path, "W8A16", 2, torch.float16)[0]["quant_algo"] == "W8A16"
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization"]["quant_algo"] = "NVFP4"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="ModelOpt quant_algo 'NVFP4' is not supported; expected one of"):
        read_export(tmp_path, "W8A16", 2, torch.float16)


# ---------------------------------------------------------------------------------------------
# bad input through the real console script: one line, exit 1, nothing written


def _missing(calib, tmp):
    return ["--qformat", "int4_awq", "--group_size", "32", "--calib_dataset", str(tmp / "nope.txt")], "calibration dataset " \
        f"{tmp / 'nope.txt'} not found"


def _empty(calib, tmp):
    (tmp / "empty.jsonl").write_text("\n")
    return ["--qformat", "fp8", "--calib_dataset", str(tmp / "empty.jsonl")], "is empty (no text to calibrate on)"


def _bad_jsonl(calib, tmp):
    (tmp / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": 1}\n')
    return ["--qformat", "fp8", "--calib_dataset", str(tmp / "bad.jsonl")], "line 2 has no string \"text\" field"


def _group(calib, tmp):
    return (["--qformat", "int4_awq", "--group_size", "48", "--calib_dataset", str(calib)],
            "--group_size 48 does not divide the input dimension 64 of attention.qkv (shape [128, 64])")


def _no_calib(calib, tmp):
    return ["--qformat", "int4_gptq", "--group_size", "32"], "int4_gptq needs calibration data: pass --calib_dataset"


def _kv_no_calib(calib, tmp):
    return ["--kv_cache_dtype", "int8"], "--kv_cache_dtype int8 needs calibration data"


def _tp(calib, tmp):
    return (["--qformat", "int4_wo", "--tp_size", "2", "--group_size", "64"],
            "--group_size 64 does not divide the input dimension 32 that each of --tp_size 2 ranks holds of "
            "attention.dense")


@pytest.mark.parametrize("make", [_missing, _empty, _bad_jsonl, _group, _no_calib, _kv_no_calib, _tp],
                         ids=lambda f: f.__name__.strip("_"))
def test_bad_input(hf_model, calib_file, tmp_path, make):
    args, message = make(calib_file, tmp_path)
    out = tmp_path / "out" / "ckpt"
    proc = subprocess.run([str(CONSOLE_SCRIPT), "--model_dir", str(hf_model("llama")), "--output_dir",
                           str(out), *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_qformat_lists_the_choices(hf_model, tmp_path):
    proc = subprocess.run([str(CONSOLE_SCRIPT), "--model_dir", str(hf_model("llama")), "--output_dir",
                           str(tmp_path / "c"), "--qformat", "int3_magic"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Invalid value for '--qformat': 'int3_magic' is not one of" in proc.stderr
    for name in ALGO:
        assert f"'{name}'" in proc.stderr
    assert not (tmp_path / "c").exists()
