"""The model's op set (kiln/models/ops/): each op group's kernel family chosen once at build from
the plugin settings and recorded in the engine, and the attention module each layer gets."""
import json

import pytest

from kiln.config import ConfigError
from kiln.models.attention import FusedAttention, ProjectionNorm, SplitAttention, make_attention
from kiln.models.ops.base import AttentionLayer
from kiln.models.ops.op_set import OpSet, choose
from kiln.models.parallel import TensorParallel
from kiln.plugins import cpu

CPP = {"attention": "cpp", "gemm": "cpp", "norm": "cpp", "rotary": "cpp", "activation": "cpp"}


def test_plugin_settings_choose_the_families():
    assert choose({"gpt_attention_plugin": "cpp", "gemm_plugin": "cpp", "rmsnorm_plugin": "cpp",
                   "rope_plugin": "cpp", "swiglu_plugin": "cpp"}) == CPP
    assert choose({"gpt_attention_plugin": "python", "gemm_plugin": "python", "rmsnorm_plugin": None,
                   "rope_plugin": "inline", "swiglu_plugin": "python"}) == {
        "attention": "python", "gemm": "inline", "norm": "inline", "rotary": "inline", "activation": "python"}


def test_an_unknown_family_or_group_is_refused():
    with pytest.raises(ConfigError, match="op_set .* is not valid; expected a family among inline, python, cpp"):
        OpSet({**CPP, "attention": "cuda"})
    with pytest.raises(ConfigError, match="for each of attention, gemm, norm, rotary, activation"):
        OpSet({"attention": "cpp"})


def test_an_op_the_family_lacks_is_the_references():
    ops = OpSet(CPP)
    assert ops.act_and_mul("gelu_pytorch_tanh") is cpu.gelu_tanh_and_mul  # no plugin has GeGLU
    assert ops.kv_cache_write is cpu.kv_cache_write  # beside the C++ attention, one index_put_ inline
    assert ops.packed_gemm and not OpSet(dict.fromkeys(CPP, "inline")).packed_gemm


@pytest.mark.parametrize("layer, fused", [
    (dict(), True),
    (dict(qk_norm="head", window=16, softcap=50.0), True),  # Gemma 3 / Gemma 2 layers: still one call
    (dict(rotary=False), False),  # SmolLM3's NoPE layers
    (dict(quantized_kv=True), False),  # an 8-bit pool keeps the separate write and its scale
    (dict(qk_norm="projection"), False),  # OLMo 2: the norm spans the rank's heads, all-reduced
])
def test_each_layer_gets_one_call_where_the_cpp_attention_covers_it(layer, fused):
    from kiln.config import PretrainedConfig

    spec = AttentionLayer(0, 4, 2, 16, 0.25, 1e-6, **layer)
    config = PretrainedConfig("LlamaForCausalLM", "float32", 64, 64, 1, 4, 2, 16, 96, 128)
    module = make_attention(spec, OpSet(CPP), TensorParallel(config, 0), 4, 2)
    assert isinstance(module, FusedAttention if fused else SplitAttention)
    if layer.get("qk_norm") == "projection":
        assert isinstance(module.qk_norm, ProjectionNorm)
    # the reference family has no fused call: every layer splits
    assert isinstance(make_attention(spec, OpSet(dict.fromkeys(CPP, "inline")), TensorParallel(config, 0), 4, 2),
                      SplitAttention)


def test_the_engine_records_its_op_set(engine):
    config = json.loads((engine("llama") / "config.json").read_text())["build_config"]
    assert config["op_set"] == choose(config["plugin_config"])
    assert config["op_set"]["attention"] == "inline"  # eager: the builder's choice, attention traced inline


def test_inputs_embeds_and_hidden_states_are_inert_until_asked(checkpoint):
    """Embeddings given whole stand for the lookup (images, later), and the hidden states a draft
    model asks for come back beside the logits (EAGLE, later); an engine asks for neither."""
    import torch

    from kiln.build.export import example_inputs
    from kiln.build.weights import load_rank_weights
    from kiln.config import BuildConfig, PretrainedConfig
    from kiln.models.llama import LlamaForCausalLM

    ckpt = checkpoint("llama")
    config = PretrainedConfig.load(ckpt)
    weights = load_rank_weights(ckpt, config, 0)
    inputs = example_inputs(config, BuildConfig(max_batch_size=4, max_input_len=16, max_seq_len=64))
    reference = OpSet(dict.fromkeys(CPP, "inline"))
    with torch.no_grad():
        model = LlamaForCausalLM(config, weights, 0, reference)
        logits = model(**{k: v.clone() for k, v in inputs.items()})
        embeds = torch.nn.functional.embedding(inputs["input_ids"], weights["transformer.vocab_embedding.weight"])
        assert torch.equal(model(**{k: v.clone() for k, v in inputs.items()}, inputs_embeds=embeds), logits)
        layers = (0, config.num_hidden_layers - 1)
        drafted = LlamaForCausalLM(config, weights, 0, reference, hidden_state_layers=layers)
        out, hidden = drafted(**{k: v.clone() for k, v in inputs.items()})
    assert torch.equal(out, logits)
    assert {k: v.shape for k, v in hidden.items()} == {
        f"layers.{i}": (inputs["input_ids"].shape[0], config.hidden_size) for i in layers}
