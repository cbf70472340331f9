"""config.json -> checkpoint config for both transformers majors: every field of the installed
transformers' config classes is read, refused or known to be irrelevant; defaults are HF's; YaRN is
HF's to the bit; each refused key is a one-line error naming key, value and what is supported."""
import dataclasses
import inspect
import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from kiln.config import ConfigError, MoeConfig
from kiln.convert.cli import convert_checkpoint
from kiln.convert.hf_config import (FAMILIES, IGNORED, IGNORED_BY_FAMILY, MAPPED, pretrained_config_from_hf,
                                    read_hf_config)
from kiln.convert.hf_rope import REFUSED_ROPE_TYPES, ROPE_TYPES
from kiln.models import rope

CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
           "granite": "GraniteConfig", "olmo2": "Olmo2Config", "smollm3": "SmolLM3Config",
           "phi3": "Phi3Config", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig"}
# 32 heads: HF's default num_key_value_heads (32 for Qwen, 8 for Mistral) must divide them.
SIZES = dict(vocab_size=128, hidden_size=1024, num_hidden_layers=2, num_attention_heads=32, intermediate_size=512)
MAJOR = int(transformers.__version__.split(".")[0])


def fields_of(cls) -> set[str]:
    """Every field a config class has: what it writes, what its constructor takes, its dataclass fields (5.x)."""
    names = set(cls().to_dict()) | set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return names | set(getattr(cls, "attribute_map", {}))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_field_of_the_config_class_is_classified(family):
    fields = fields_of(getattr(transformers, CLASSES[family]))
    unclassified = sorted(fields - MAPPED[family] - IGNORED - IGNORED_BY_FAMILY[family])
    assert not unclassified, (f"transformers {transformers.__version__} {CLASSES[family]} has field(s) "
                              f"{unclassified} that kiln/convert/hf_config.py neither reads, refuses nor ignores")


def test_the_table_in_the_docstring_names_every_key_read_or_refused():
    from kiln.convert import hf_config

    keys = set().union(*MAPPED.values(), hf_config.FOREIGN, *hf_config.FOREIGN_BY_FAMILY.values(),
                       *ROPE_TYPES.values(), REFUSED_ROPE_TYPES)
    assert not sorted(k for k in keys if k not in hf_config.__doc__)


def test_every_rope_type_and_key_of_transformers_is_classified():
    from transformers import modeling_rope_utils as hf_rope

    types = set(hf_rope.ROPE_INIT_FUNCTIONS) | {"default"}
    assert types <= set(ROPE_TYPES) | set(REFUSED_ROPE_TYPES), types - set(ROPE_TYPES) - set(REFUSED_ROPE_TYPES)
    if hasattr(hf_rope, "RopeParameters"):  # transformers 5's schema of rope_parameters
        known = set().union(*ROPE_TYPES.values()) | {"rope_type", "rope_theta", "partial_rotary_factor",
                                                     "short_factor", "long_factor"}  # the last two: longrope's
        assert set(hf_rope.RopeParameters.__annotations__) <= known


def hf_dict(family: str, **kw) -> dict:
    """config.json as the installed transformers writes it."""
    cfg = getattr(transformers, CLASSES[family])(**SIZES, **kw)
    return dict(cfg.to_dict(), architectures=[FAMILIES[family]])


@pytest.mark.parametrize("family", FAMILIES)
def test_absent_keys_take_hfs_defaults(family):
    minimal = {"architectures": [FAMILIES[family]], "model_type": family, **SIZES}
    hf = getattr(transformers, CLASSES[family])(**SIZES)
    ours = pretrained_config_from_hf(minimal)
    # HF's Mistral slides a 4096 window over its 131072 positions by default; Gemma 3 on most layers (below)
    if family not in ("gemma2", "gemma3_text"):
        want = (4096, None) if family == "mistral" else (None, None)
        assert (ours.sliding_window, ours.sliding_window_layers) == want
    # Gemma 3 keys its rope_parameters by layer type
    rope = hf.rope_parameters.get("full_attention", hf.rope_parameters) if MAJOR >= 5 else None
    theta = rope["rope_theta"] if MAJOR >= 5 else hf.rope_theta
    assert (ours.num_key_value_heads, ours.head_size, ours.norm_epsilon, ours.rotary_base, ours.rotary_scaling,
            ours.tie_word_embeddings, ours.max_position_embeddings, ours.hidden_act) == (
        hf.num_key_value_heads, getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        hf.rms_norm_eps, theta, None, hf.tie_word_embeddings, hf.max_position_embeddings,
        getattr(hf, "hidden_act", None) or hf.hidden_activation)
    assert ours.attn_bias == (family == "qwen2" or bool(getattr(hf, "qkv_bias", False)))
    assert ours.qk_layernorm == (family in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text"))
    gemma = family in ("gemma2", "gemma3_text")
    assert (ours.pre_norm, ours.post_norm, ours.qk_layernorm_scope) == (
        (False, True, "projection") if family == "olmo2" else (True, gemma, "head"))
    if gemma:  # Gemma 3: a local rope on the sliding layers, all but every sixth; Gemma 2: every other one
        assert ours.hidden_act == hf.hidden_activation == "gelu_pytorch_tanh"
        assert (ours.norm_weight_offset, ours.attention_multiplier, ours.sliding_window, ours.final_logit_softcapping,
                ours.attn_logit_softcapping) == (1.0, hf.query_pre_attn_scalar ** -0.5, hf.sliding_window,
                                                 hf.final_logit_softcapping, hf.attn_logit_softcapping)
        local = None if family == "gemma2" else hf.rope_parameters["sliding_attention"]["rope_theta"] \
            if MAJOR >= 5 else hf.rope_local_base_freq
        assert ours.rotary_base_local == local
        assert [ours.window_of(i) for i in range(SIZES["num_hidden_layers"])] == [
            hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types]
        assert ours.embedding_multiplier == pytest.approx(hf.hidden_size ** 0.5, rel=1e-7)
        return
    granite = (hf.embedding_multiplier, hf.residual_multiplier, hf.attention_multiplier, hf.logits_scaling) \
        if family == "granite" else (1.0, 1.0, None, 1.0)  # Granite's default attention multiplier is 1, not 1/sqrt(d)
    assert (ours.embedding_multiplier, ours.residual_multiplier, ours.attention_multiplier,
            ours.logits_scaling) == granite
    assert ours.nope_layers == ([i for i, r in enumerate(hf.no_rope_layers) if not r] if family == "smollm3" else [])
    if family == "mixtral":  # always renormalized; experts as wide as intermediate_size
        want = (MoeConfig(hf.num_local_experts, hf.num_experts_per_tok, 1, 0), hf.intermediate_size, 1, [])
    elif family in ("qwen2_moe", "qwen3_moe"):
        want = (MoeConfig(hf.num_experts, hf.num_experts_per_tok, int(hf.norm_topk_prob),
                          getattr(hf, "shared_expert_intermediate_size", 0)),
                hf.moe_intermediate_size, hf.decoder_sparse_step, hf.mlp_only_layers)
    else:
        want = (MoeConfig(), 0, 1, [])
    assert (ours.moe, ours.moe_intermediate_size, ours.decoder_sparse_step, ours.mlp_only_layers) == want
    assert ours.intermediate_size == hf.intermediate_size


# The same model in each schema: what transformers 4 writes and what transformers 5 writes.
SCHEMAS = [
    ({"rope_theta": 5e5, "rope_scaling": None}, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
     None),
    ({"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}},
     {"rope_parameters": {"type": "linear", "rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     {"type": "linear", "factor": 2.0}),
    ({"rope_theta": 1e4, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
     {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
     {"type": "dynamic", "factor": 4.0}),
    ({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     {"rope_parameters": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_theta": 5e5}},
     {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}),
    ({"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                          "rope_theta": 1e6}},
     {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32.0,
      "beta_slow": 1.0, "truncate": True, "attention_factor": 0.1 * math.log(4.0) + 1}),
]


@pytest.mark.parametrize("v4,v5,scaling", SCHEMAS, ids=["default", "linear", "dynamic", "llama3", "yarn"])
def test_both_schemas_read_the_same(v4, v5, scaling):
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SIZES, "max_position_embeddings": 131072}
    old = pretrained_config_from_hf({**base, **v4, "torch_dtype": "bfloat16"})
    new = pretrained_config_from_hf({**base, **v5, "dtype": "bfloat16"})
    assert old == new
    assert (new.rotary_base, new.rotary_scaling, new.dtype) == (list(v5.values())[0]["rope_theta"], scaling,
                                                                "bfloat16")


def test_per_layer_type_rope_parameters():
    # transformers 5 may key rope_parameters by layer type; one rope shared by all layers is fine.
    hf = {k: v for k, v in hf_dict("qwen3").items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 123.0}}
    assert pretrained_config_from_hf(hf).rotary_base == 123.0


YARN = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5/Qwen3
    {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 0.707},  # DeepSeek-style mscale ratio
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "attention_factor": 0.9,
     "beta_fast": 16.0, "beta_slow": 2.0},
    {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "truncate": False},  # gpt-oss-style
    {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 131072},
]


@pytest.mark.parametrize("scaling", YARN, ids=["qwen", "mscale", "attention_factor", "no_truncate", "factor_1"])
def test_yarn_is_hfs_to_the_bit(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.Qwen2Config(**SIZES, max_position_embeddings=131072, rope_theta=1e6,
                                      rope_scaling=dict(scaling))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours = pretrained_config_from_hf(dict(hf_cfg.to_dict(), architectures=["Qwen2ForCausalLM"]))
    assert ours.rotary_scaling["type"] == "yarn"
    assert torch.equal(rope.inv_freq(ours), want_freq)
    assert rope.attention_factor(ours) == pytest.approx(want_factor, rel=1e-12)
    # A ModelOpt export carries HF's rope_scaling as it was: rope.py fills in HF's defaults itself.
    raw = dataclasses.replace(ours, rotary_scaling={**scaling, "type": "yarn"})
    assert torch.equal(rope.inv_freq(raw), want_freq)
    assert rope.attention_factor(raw) == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("partial", [1.0, 0.75], ids=["phi3.5", "phi4-mini"])
def test_longrope_is_hfs_to_the_bit(partial):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    pairs = int(SIZES["hidden_size"] // SIZES["num_attention_heads"] * partial) // 2
    hf_cfg = transformers.Phi3Config(**SIZES, max_position_embeddings=131072, original_max_position_embeddings=4096,
                                     partial_rotary_factor=partial, rope_scaling={
                                         "type": "longrope", "short_factor": [1 + i / 50 for i in range(pairs)],
                                         "long_factor": [1 + i * 4.0 for i in range(pairs)]}, pad_token_id=0)
    ours = pretrained_config_from_hf(dict(hf_cfg.to_dict(), architectures=["Phi3ForCausalLM"]))
    assert (ours.long_rope_threshold, ours.rotary_dim) == (4096, 2 * pairs)
    for long, seq_len in ((False, None), (True, 4097)):
        want_freq, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, "cpu", seq_len=seq_len)
        assert torch.equal(rope.inv_freq(ours, long=long), want_freq)
        assert rope.attention_factor(ours) == pytest.approx(want_factor, rel=1e-12)


def test_text_config(tmp_path, hf_model):
    """A text model nested in text_config with its weights under the multimodal prefixes converts
    like the plain causal LM."""
    from safetensors.torch import load_file, save_file

    src = hf_model("qwen3")
    plain = convert_checkpoint(src, tmp_path / "plain")
    text = json.loads((src / "config.json").read_text())
    weights = load_file(src / "model.safetensors")
    for outer_arch, (model, head) in (("Mistral3ForConditionalGeneration", ("model.language_model.", "lm_head.")),
                                      ("LlavaForConditionalGeneration", ("language_model.model.", "language_model.lm_head."))):
        d = tmp_path / outer_arch
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": [outer_arch], "model_type": "llava",
                                                   "vision_config": {"hidden_size": 8}, "text_config": text}))
        renamed = {(model + k[len("model."):]) if k.startswith("model.") else head + k[len("lm_head."):]: v
                   for k, v in weights.items()}
        save_file({**renamed, "vision_tower.patch_embed.weight": torch.zeros(2, 2)}, d / "model.safetensors")
        out = convert_checkpoint(d, tmp_path / f"{outer_arch}.ckpt")
        assert json.loads((out / "config.json").read_text()) == json.loads((plain / "config.json").read_text())
        assert (out / "rank0.safetensors").read_bytes() == (plain / "rank0.safetensors").read_bytes()


def _set(**kw):
    return lambda hf: hf.update(kw)


def _rope(scaling, theta=None):
    def edit(hf):
        hf.pop("rope_scaling", None)
        hf.pop("rope_theta", None)
        hf["rope_parameters"] = scaling
        if theta is not None:
            hf["rope_theta"] = theta
    return edit


# (family, edit of the installed transformers' config.json, the one-line error it must give)
REFUSED = [
    ("llama", _set(model_type="mistral"), "model_type 'mistral' does not match architecture LlamaForCausalLM"),
    ("llama", lambda hf: hf.pop("intermediate_size"), "missing field(s): intermediate_size"),
    ("llama", _set(hidden_act="gelu"), "hidden_act 'gelu' is not supported; expected 'silu'"),
    ("llama", _set(attention_bias=True), "attention_bias=True is not supported for LlamaForCausalLM (expected false"),
    ("qwen3", _set(attention_bias=True), "attention_bias=True is not supported for Qwen3ForCausalLM (expected false"),
    ("llama", _set(mlp_bias=True), "mlp_bias=True is not supported for LlamaForCausalLM (expected false"),
    ("qwen3", _set(head_dim=None), "head_dim null is not supported for Qwen3ForCausalLM; expected an integer"),
    ("llama", _set(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported; expected 1.0"),
    ("llama", _rope({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
     "the rope dict's partial_rotary_factor 0.25 is not supported; expected 1.0"),
    ("llama", _rope({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
                     "original_max_position_embeddings": 64}),
     "rope_type 'longrope' is supported for Phi3ForCausalLM only"),
    ("phi3", _rope({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16, "factor": 4.0}),
     "rope longrope key(s) factor are not understood; expected only long_factor, original_max_position_embeddings, "
     "short_factor"),
    ("phi3", lambda hf: (_rope({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                                "original_max_position_embeddings": 64})(hf),
                         hf.update(original_max_position_embeddings=4096)),
     "original_max_position_embeddings is 64 in the rope dict but 4096 at the top level"),
    ("phi3", _rope({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3}),
     "rotary_scaling.short_factor has 3 factors; expected 16 (one per pair of the 32 rotary dims)"),
    ("phi3", _rope({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [0.0] * 16}),
     "rope longrope long_factor [0.0, 0.0"),
    ("phi3", lambda hf: (_rope({"rope_type": "default", "partial_rotary_factor": 0.75})(hf),
                         hf.update(partial_rotary_factor=0.5)),
     "partial_rotary_factor 0.5 and the rope dict's 0.75 disagree"),
    ("phi3", _set(partial_rotary_factor=1.5),
     "partial_rotary_factor 1.5 is not supported; expected a number in (0, 1]"),
    ("llama", _rope({"rope_type": "proportional", "rope_theta": 1e4}), "rope_type 'proportional' is not supported"),
    ("llama", _rope({"rope_type": "linear", "factor": 2.0, "mscale": 1.0}),
     "rope linear key(s) mscale are not understood; expected only factor"),
    ("llama", _rope({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
     "rope llama3 is missing high_freq_factor"),
    ("llama", _rope({"rope_type": "linear"}), "rope linear is missing factor"),
    ("llama", _rope({"rope_type": "default", "rope_theta": 1e6}, theta=1e4),
     "rope_theta 10000.0 and the rope dict's rope_theta 1000000.0 disagree"),
    ("llama", _rope({"type": "linear", "rope_type": "dynamic", "factor": 2.0}),
     "the rope dict's type and rope_type disagree (dynamic, linear)"),
    ("llama", lambda hf: hf.update(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                   rope_parameters={"rope_type": "linear", "factor": 4.0}),
     "rope_scaling {'rope_type': 'linear', 'factor': 2.0} and rope_parameters"),
    ("llama", _set(rope_scaling="linear"), "rope_scaling must be an object or null, got 'linear'"),
    ("qwen3", lambda hf: hf.update(rope_parameters={"full_attention": {"rope_type": "default"},
                                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0}},
                                   layer_types=["full_attention", "sliding_attention"]),
     "rope_parameters differ between layer types (full_attention, sliding_attention)"),
    ("llama", lambda hf: (_rope({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})(hf),
                          hf.update(original_max_position_embeddings=64)),
     "original_max_position_embeddings is 64 at the top level but absent (so 2048) in the rope dict"),
    ("qwen2", _set(layer_types=["full_attention", "chunked_attention"]), "layer_types ['full_attention', "
     "'chunked_attention'] is not supported; expected 2 entries of 'full_attention' or 'sliding_attention'"),
    ("llama", _set(dtype="float64"), "dtype 'float64' is not supported; pass --dtype with one of float32"),
    ("llama", lambda hf: (hf.pop("dtype", None), hf.update(torch_dtype="int8")), "torch_dtype 'int8' is not supported"),
    ("llama", _set(text_config="llama"), "text_config must be an object, got 'llama'"),
    ("llama", _set(rms_norm_eps=None), "rms_norm_eps null is not supported; expected a value (absent, HF's "
     "default for LlamaForCausalLM is 1e-06)"),
    ("qwen2", _set(rope_theta=None, rope_scaling=None, rope_parameters=None), "rope_theta null is not supported"),
    # mixture of experts
    ("mixtral", _set(num_experts_per_tok=9),
     "num_experts_per_tok 9 is not supported; expected an integer in 1 .. 8 (num_local_experts)"),
    ("qwen3_moe", _set(num_experts_per_tok=0), "num_experts_per_tok 0 is not supported; expected an integer in 1 .. "
     "128"),
    ("qwen2_moe", _set(num_experts=0), "num_experts 0 is not supported; expected an integer >= 1"),
    ("mixtral", _set(num_local_experts=None), "num_local_experts null is not supported; expected a value (absent, "
     "HF's default for MixtralForCausalLM is 8)"),
    ("mixtral", _set(num_local_experts=8, num_experts=4), "num_local_experts 8 and num_experts 4 disagree"),
    ("qwen3_moe", _set(num_experts=8, num_local_experts=16), "num_experts 8 and num_local_experts 16 disagree"),
    ("qwen2_moe", _set(mlp_only_layers=1), "mlp_only_layers 1 is not supported; expected a list of layer indices"),
    ("qwen3_moe", _set(mlp_only_layers=["1"]), "mlp_only_layers ['1'] is not supported; expected a list of layer "
     "indices"),
    ("qwen3_moe", _set(decoder_sparse_step=0), "decoder_sparse_step 0 is not supported; expected an integer >= 1"),
    ("qwen2_moe", _set(moe_intermediate_size=None), "moe_intermediate_size null is not supported"),
    ("qwen2_moe", _set(shared_expert_intermediate_size=-1),
     "shared_expert_intermediate_size -1 is not supported; expected an integer >= 0"),
    ("qwen3_moe", _set(shared_expert_intermediate_size=64),
     "shared_expert_intermediate_size=64 is not supported for Qwen3MoeForCausalLM"),
    ("mixtral", _set(shared_expert_intermediate_size=64),
     "shared_expert_intermediate_size=64 is not supported for MixtralForCausalLM"),
    ("qwen3_moe", _set(attention_bias=True), "attention_bias=True is not supported for Qwen3MoeForCausalLM (expected "
     "false"),
    ("qwen3_moe", _set(head_dim=None), "head_dim null is not supported for Qwen3MoeForCausalLM; expected an integer"),
    ("qwen2_moe", _set(head_dim=None), "head_dim null is not supported for Qwen2MoeForCausalLM; expected an integer"),
    # transformers 4 slides every layer whatever layer_types says
    ("qwen2_moe", _set(use_sliding_window=True, sliding_window=64, layer_types=["full_attention"] * 2),
     "sliding_window 64 is smaller than max_position_embeddings 32768 (on layer(s) 0, 1); a windowed Qwen2-MoE "
     "is not supported"),
    ("qwen2_moe", _set(use_sliding_window=False, sliding_window=0, layer_types=["full_attention", "sliding_attention"]),
     "layer_types marks layer(s) 1 'sliding_attention' but use_sliding_window is false"),
    ("qwen2_moe", _set(layer_types=["full_attention"]), "layer_types ['full_attention'] is not supported; expected 2 "
     "entries"),
    ("gemma2", _set(attn_logit_softcapping=-50.0), "attn_logit_softcapping -50.0 is not supported; expected null or "
     "a number > 0"),
    ("gemma3_text", _set(use_bidirectional_attention=True), "use_bidirectional_attention true is not supported"),
    ("gemma3_text", _set(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported; expected "
     "'gelu_pytorch_tanh'"),
    ("gemma3_text", _set(final_logit_softcapping=-1.0), "final_logit_softcapping -1.0 is not supported"),
    ("granite", _set(logits_scaling=0), "logits_scaling 0 is not supported; expected a finite number other than 0"),
    ("granite", _set(attention_multiplier="0.1"), "attention_multiplier '0.1' is not supported; expected a finite "
     "number"),
    ("granite", _set(attention_bias=True), "attention_bias=True is not supported for GraniteForCausalLM"),
    ("olmo2", _set(attention_bias=True), "attention_bias=True is not supported for Olmo2ForCausalLM"),
    ("smollm3", _set(mlp_bias=True), "mlp_bias=True is not supported for SmolLM3ForCausalLM"),
    ("smollm3", _set(no_rope_layers=[1, 2]), "no_rope_layers [1, 2] is not supported; expected 2 entries of 1"),
    ("smollm3", _set(no_rope_layers=[1]), "no_rope_layers [1] is not supported"),
    ("olmo2", _set(logits_scaling=8.0), "logits_scaling=8.0 is not supported for Olmo2ForCausalLM"),
    *[("llama", _set(**{key: value}), f"{key}={value!r} is not supported for LlamaForCausalLM")
      for key, value in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0), ("logits_scaling", 8.0),
                         ("embedding_multiplier", 12.0), ("residual_multiplier", 0.22),
                         ("attention_multiplier", 0.0078125), ("query_pre_attn_scalar", 256), ("use_mrope", True))],
]


# (family, edit, the sliding_window and sliding_window_layers it must map to)
WINDOWS = [
    ("mistral", _set(sliding_window=1024, max_position_embeddings=4096), (1024, None)),
    ("mistral", _set(sliding_window=4096, max_position_embeddings=4096), (None, None)),  # no query reaches past it
    ("mixtral", _set(sliding_window=1024, max_position_embeddings=4096), (1024, None)),
    ("qwen2", _set(use_sliding_window=True, sliding_window=64, layer_types=["full_attention", "sliding_attention"]),
     (64, [1])),
    ("qwen2", _set(use_sliding_window=False, sliding_window=64), (None, None)),
    ("qwen3", _set(use_sliding_window=True, sliding_window=64, max_window_layers=0, layer_types=None), (64, None)),
    ("qwen3_moe", _set(use_sliding_window=True, sliding_window=64), (64, None)),
    ("smollm3", _set(use_sliding_window=True, sliding_window=64, layer_types=["full_attention", "sliding_attention"]),
     (64, [1])),
    ("smollm3", _set(use_sliding_window=True, sliding_window=64, layer_types=None, no_rope_layers=[1, 0]), (64, [1])),
    ("smollm3", _set(use_sliding_window=False, sliding_window=64), (None, None)),
]


@pytest.mark.parametrize("family,edit,want", WINDOWS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(WINDOWS)])
def test_sliding_windows_where_hf_slides_them(family, edit, want):
    hf = hf_dict(family)
    edit(hf)
    ours = pretrained_config_from_hf(hf)
    assert (ours.sliding_window, ours.sliding_window_layers) == want
    assert [ours.window_of(i) for i in range(2)] == [
        0 if want[0] is None or (want[1] is not None and i not in want[1]) else want[0] for i in range(2)]


@pytest.mark.parametrize("family,edit,message", REFUSED, ids=[f"{f}: {m.split(' ')[0]}" for f, _, m in REFUSED])
def test_refused_keys_are_one_line_errors(family, edit, message):
    hf = hf_dict(family)
    edit(hf)
    with pytest.raises(ConfigError) as err:
        pretrained_config_from_hf(hf, where="m/config.json")
    text = str(err.value)
    assert text.startswith("m/config.json: ") and "\n" not in text
    assert message in text, text


# (family, config class kwargs at tiny sizes, the MoE fields they must map to:
#  moe, moe_intermediate_size, decoder_sparse_step, mlp_only_layers, attn_bias, qk_layernorm, MoE layers)
TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
SAVED = [
    ("mixtral", dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
     (MoeConfig(8, 2, 1, 0), 32, 1, [], False, False, [True, True])),
    ("qwen2_moe", dict(intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, mlp_only_layers=[1]),
     (MoeConfig(8, 2, 0, 48), 32, 1, [1], True, False, [True, False])),
    ("qwen2_moe", dict(intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=True, qkv_bias=False, decoder_sparse_step=2),
     (MoeConfig(8, 2, 1, 48), 32, 2, [], False, False, [False, True])),
    ("qwen3_moe", dict(intermediate_size=96, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, head_dim=32),
     (MoeConfig(8, 2, 1, 0), 32, 1, [], False, True, [True, True])),
    ("qwen3_moe", dict(intermediate_size=96, num_experts=8, num_experts_per_tok=8, moe_intermediate_size=32,
                       mlp_only_layers=[0]),
     (MoeConfig(8, 8, 0, 0), 32, 1, [0], False, True, [False, True])),
]


@pytest.mark.parametrize("family,kw,want", SAVED, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(SAVED)])
def test_moe_configs_saved_by_transformers(tmp_path, family, kw, want):
    hf_cfg = getattr(transformers, CLASSES[family])(**TINY, **kw, architectures=[FAMILIES[family]])
    hf_cfg.save_pretrained(tmp_path)
    hf = read_hf_config(tmp_path)
    if MAJOR >= 5 and family == "qwen2_moe":  # transformers 5 writes the switched-off window as 0
        assert (hf["sliding_window"], hf["use_sliding_window"]) == (0, False)
    ours = pretrained_config_from_hf(hf, where=tmp_path / "config.json")
    assert (ours.moe, ours.moe_intermediate_size, ours.decoder_sparse_step, ours.mlp_only_layers, ours.attn_bias,
            ours.qk_layernorm, [ours.is_moe_layer(i) for i in range(2)]) == want
    assert (ours.architecture, ours.intermediate_size, ours.hidden_size, ours.num_attention_heads,
            ours.num_key_value_heads, ours.head_size) == (FAMILIES[family], kw["intermediate_size"], 64, 4, 2,
                                                          kw.get("head_dim", 16))
    # HF's model reads the same numbers
    experts = hf_cfg.num_local_experts if family == "mixtral" else hf_cfg.num_experts
    assert (experts, hf_cfg.num_experts_per_tok) == (ours.moe.num_experts, ours.moe.top_k)


def test_either_name_of_the_experts_count():
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (and reads Mixtral's num_experts)
    for family, key in (("qwen3_moe", "num_local_experts"), ("qwen3_moe", "num_experts"),
                        ("mixtral", "num_experts"), ("mixtral", "num_local_experts")):
        hf = {"architectures": [FAMILIES[family]], "model_type": family, **TINY, "intermediate_size": 32,
              key: 16, "num_experts_per_tok": 4}
        assert pretrained_config_from_hf(hf).moe.num_experts == 16
    both = {"architectures": ["Qwen3MoeForCausalLM"], **TINY, "intermediate_size": 32, "num_experts": 16,
            "num_local_experts": 16}
    assert pretrained_config_from_hf(both).moe.num_experts == 16


def test_a_released_qwen3_moe_config():
    """Qwen3-30B-A3B's config.json (transformers 4.51), sizes shrunk: max_window_layers and a null
    sliding_window are carried along and change nothing."""
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
          "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
          "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
          "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
          "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
          "num_experts_per_tok": 8, "num_hidden_layers": 4, "num_key_value_heads": 4, "output_router_logits": False,
          "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
          "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
          "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
    ours = pretrained_config_from_hf(hf)
    assert (ours.moe, ours.moe_intermediate_size, ours.head_size, ours.qk_layernorm, ours.attn_bias, ours.dtype,
            ours.rotary_base) == (MoeConfig(128, 8, 1, 0), 768, 128, True, False, "bfloat16", 1e6)
    assert all(ours.is_moe_layer(i) for i in range(4))


def test_the_declared_transformers_range_is_what_make_test_runs():
    tomllib = pytest.importorskip("tomllib")
    from packaging.specifiers import SpecifierSet

    root = Path(__file__).parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = SpecifierSet(next(d for d in deps if d.startswith("transformers"))[len("transformers"):])
    pins = [line.split("==")[1] for name in ("cpu.txt", "transformers5.txt")
            for line in (root / "requirements" / name).read_text().splitlines() if line.startswith("transformers==")]
    assert pins == ["4.57.6", "5.13.1"] and all(v in spec for v in pins)
    untested = ["4.56.2", "4.57.5", *(f"5.{minor}.0" for minor in range(13)), "5.14.0"]
    assert [v for v in untested if v in spec] == []
