"""EAGLE-3 drafts (Li et al. 2025) in the format their checkpoints are published in
(`LlamaForCausalLMEagle3`: yuhuili/EAGLE3-*, SpecForge; the names vLLM's llama_eagle3.py loads).

A draft is one decoder layer over [its embedding of the next token; the target's hidden states],
where the target's states are three of its layers' outputs fused by `fc` (3 * target hidden -> hidden).
Its attention's q/k/v read both halves (2 * hidden in), its residual stream starts from the fused
state, and its logits cover a smaller vocabulary (`draft_vocab_size`) that `d2t` maps into the
target's: target id = draft id + d2t[draft id]. Drafting token j > 1 feeds back the layer's own
pre-norm output at the previous position instead of the target's fused state.

The target layers are named as vLLM names them (`eagle_aux_hidden_state_layer_ids`, in config.json
or its `eagle_config`): id j is the residual stream entering layer j, the output of layer j - 1;
without them, vLLM's default (2, n // 2, n - 3) for an n-layer target.

The draft runs on the core process's CPU in float32 with a paged KV pool of its own (one layer), on
the C++ plugins' ops (eager, not compiled); it is not sharded under tensor parallelism (one layer,
replicated).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from kiln.config import ConfigError, PretrainedConfig, read_json
from kiln.models import rope
from kiln.models.attention import make_attention
from kiln.models.ops.base import AttentionLayer, StepMeta
from kiln.models.ops.op_set import GROUPS, OpSet
from kiln.models.parallel import TensorParallel

WEIGHTS = "model.safetensors"
DRAFT_DIR = "eagle3"  # a converted draft, in a checkpoint dir (convert_checkpoint --eagle_model_dir) and an engine dir
# Published names -> ours: the one layer is "midlayer." in EAGLE's own checkpoints, "layers.0." in others.
_LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")


@dataclass(frozen=True)
class DraftShape:
    """What a draft must agree on with its target, from its config.json."""
    hidden_size: int
    target_hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # vLLM's: id j = the output of target layer j - 1
    norm_before_residual: bool

    @property
    def captured_layers(self) -> list[int]:
        """The target layers whose outputs the engine returns (kiln.models.llama's hidden_state_layers)."""
        return [j - 1 for j in self.aux_layer_ids]


def is_eagle3(hf: dict) -> bool:
    return any("eagle3" in a.lower() for a in hf.get("architectures") or ())


def draft_shape(hf: dict, target_layers: int, where) -> DraftShape:
    if not is_eagle3(hf):
        raise ConfigError(f"{where}: architectures {hf.get('architectures')} is not an EAGLE-3 draft "
                          f"(expected LlamaForCausalLMEagle3, as EAGLE-3 checkpoints are published)")
    if hf.get("num_hidden_layers", 1) != 1:
        raise ConfigError(f"{where}: an EAGLE-3 draft with {hf['num_hidden_layers']} layers is not supported; "
                          f"expected 1")
    eagle = hf.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise ConfigError(f"{where}: use_aux_hidden_state false (a draft reading only the last layer) is not "
                          f"supported; expected an EAGLE-3 draft fusing three target layers")
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids") or (
        2, target_layers // 2, target_layers - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(1 <= j < target_layers for j in ids):
        raise ConfigError(f"{where}: eagle_aux_hidden_state_layer_ids {list(ids)} must be three target layer ids "
                          f"in [1, {target_layers - 1}] (id j: the input of layer j, the output of layer j - 1) for "
                          f"a {target_layers}-layer target")
    hidden = hf["hidden_size"]
    return DraftShape(hidden, hf.get("target_hidden_size") or hidden, hf["vocab_size"],
                      hf.get("draft_vocab_size") or hf["vocab_size"], ids, bool(hf.get("norm_before_residual")))


def check_target(shape: DraftShape, target: PretrainedConfig, where) -> None:
    """A draft fits a target engine: its fused states come from the target's hidden size, its tokens
    from the target's vocabulary."""
    if shape.target_hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: the draft reads target hidden states of size {shape.target_hidden_size}, the "
                          f"target's hidden_size is {target.hidden_size}")
    if shape.vocab_size != target.vocab_size:
        raise ConfigError(f"{where}: the draft's vocab_size {shape.vocab_size} is not the target's "
                          f"{target.vocab_size}: a draft drafts in its target's vocabulary")


def read_tensors(draft_dir: Path) -> dict[str, torch.Tensor]:
    """The draft's tensors, its layer's under "layer." (its published prefix dropped)."""
    files = sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{draft_dir}: no *.safetensors file (EAGLE-3 drafts published as pytorch_model.bin: "
                          f"convert them to safetensors first; Kiln never loads pickles)")
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    out = {}
    for name, t in tensors.items():
        for prefix in _LAYER_PREFIXES:
            if name.startswith(prefix):
                name = "layer." + name[len(prefix):]
                break
        out[name.removeprefix("model.")] = t
    return out


def check_tensors(tensors: dict, shape: DraftShape, hf: dict, where) -> None:
    H, T = shape.hidden_size, shape.target_hidden_size
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    D = hf.get("head_dim") or H // heads
    inter = hf["intermediate_size"]
    expect = {
        "fc.weight": (H, 3 * T), "layer.input_layernorm.weight": (H,), "layer.hidden_norm.weight": (H,),
        "layer.self_attn.q_proj.weight": (heads * D, 2 * H), "layer.self_attn.k_proj.weight": (kv_heads * D, 2 * H),
        "layer.self_attn.v_proj.weight": (kv_heads * D, 2 * H), "layer.self_attn.o_proj.weight": (H, heads * D),
        "layer.post_attention_layernorm.weight": (H,), "layer.mlp.gate_proj.weight": (inter, H),
        "layer.mlp.up_proj.weight": (inter, H), "layer.mlp.down_proj.weight": (H, inter), "norm.weight": (H,),
        "lm_head.weight": (shape.draft_vocab_size, H), "embed_tokens.weight": (shape.vocab_size, H),
    }
    if shape.draft_vocab_size != shape.vocab_size:
        expect["d2t"] = (shape.draft_vocab_size,)
    for name, want in expect.items():
        if name not in tensors:
            raise ConfigError(f"{where}: tensor {name} is missing" + (
                " (a published draft uses its target's embeddings: convert it with convert_checkpoint "
                "--eagle_model_dir, which adds them)" if name == "embed_tokens.weight" else ""))
        if tuple(tensors[name].shape) != want:
            raise ConfigError(f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {want} "
                              f"from config.json")
    if "d2t" in expect:
        targets = torch.arange(shape.draft_vocab_size) + tensors["d2t"].long()
        if targets.min() < 0 or targets.max() >= shape.vocab_size:
            raise ConfigError(f"{where}: d2t maps draft tokens outside the target vocabulary [0, {shape.vocab_size})")


LAYER_CONFIG = "kiln_layer_config"  # in a converted draft's config.json: its layer as a Kiln PretrainedConfig


def layer_hf_config(hf: dict) -> dict:
    """The draft's layer as a one-layer Llama's HF config (its rotary tables and attention shape),
    which the converter reads into LAYER_CONFIG."""
    plain = {k: v for k, v in hf.items() if k not in ("eagle_config", "draft_vocab_size", "target_hidden_size",
                                                      LAYER_CONFIG)}
    plain.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1)
    return plain


def _families() -> dict[str, str]:
    """The C++ plugins' attention, norms, rotary and SwiGLU where they load (a draft pass is a few
    dozen small ops: the reference attention alone takes 25x the C++ op's time), ATen's GEMMs."""
    from kiln.plugins import cpp

    try:
        cpp.load()
    except Exception:  # noqa: BLE001 - no toolchain or no build: the reference ops, slower
        return dict.fromkeys(GROUPS, "inline")
    return {**dict.fromkeys(GROUPS, "cpp"), "gemm": "inline"}


class Eagle3Draft(nn.Module):
    """The draft layer over one step's flat tokens (the engine's step inputs, kiln/engine/format.py,
    on the draft's own KV pool): `fuse` turns the target's captured states into its hidden input,
    `forward` returns the draft's next-token ids in the target's vocabulary and its pre-norm output
    at the logits rows."""

    def __init__(self, hf: dict, shape: DraftShape, tensors: dict):
        super().__init__()
        self.shape = shape
        self.config = config = PretrainedConfig.from_dict(hf[LAYER_CONFIG])
        t = {k: v.float() for k, v in tensors.items() if k not in ("d2t", "t2d")}
        self.eps = config.norm_epsilon
        self.fc, self.embed, self.lm_head, self.norm = t["fc.weight"], t["embed_tokens.weight"], t["lm_head.weight"], t["norm.weight"]
        p = "layer."
        self.input_norm, self.hidden_norm = t[p + "input_layernorm.weight"], t[p + "hidden_norm.weight"]
        self.post_norm = t[p + "post_attention_layernorm.weight"]
        a = p + "self_attn."
        self.qkv = torch.cat([t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"]])
        self.o = t[a + "o_proj.weight"]
        self.gate_up = torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]])
        self.down = t[p + "mlp.down_proj.weight"]
        self.draft_to_target = torch.arange(shape.draft_vocab_size)
        if "d2t" in tensors:
            self.draft_to_target += tensors["d2t"].long()
        self.ops = ops = OpSet(_families())
        H, KH, D = config.num_attention_heads, config.num_key_value_heads, config.head_size
        self.layer = AttentionLayer(0, H, KH, D, D ** -0.5, self.eps, 0, 0.0, True, None, False)
        self.attention = make_attention(self.layer, ops, TensorParallel(config, 0), H, KH)
        self.rotary = rope.RotaryTables(config)

    @classmethod
    def load(cls, draft_dir, target: PretrainedConfig, layers: list[int], embeddings_from: Path | None = None
             ) -> Eagle3Draft:
        """layers: the target layers the engine returns (the draft must read those); embeddings_from:
        a converted draft of the same target whose embedding table a published draft (which has none)
        takes."""
        draft_dir = Path(draft_dir)
        hf = read_json(draft_dir / "config.json")
        shape = draft_shape(hf, target.num_hidden_layers, draft_dir / "config.json")
        if shape.captured_layers != layers:
            raise ConfigError(f"EAGLE-3 draft {draft_dir} reads target layers {shape.captured_layers} (outputs), the "
                              f"engine returns layers {layers}: rebuild the engine from a checkpoint converted with "
                              f"this draft")
        check_target(shape, target, draft_dir)
        if LAYER_CONFIG not in hf:
            raise ConfigError(f"{draft_dir}: an EAGLE-3 draft as published; convert it beside its target with "
                              f"convert_checkpoint --eagle_model_dir (or serve the Hugging Face target with "
                              f"speculative_config model, which converts both)")
        tensors = read_tensors(draft_dir)
        if "embed_tokens.weight" not in tensors and embeddings_from is not None and embeddings_from.is_dir():
            with safe_open(str(embeddings_from / WEIGHTS), "pt") as f:  # that tensor only
                tensors["embed_tokens.weight"] = f.get_tensor("embed_tokens.weight")
        check_tensors(tensors, shape, hf, draft_dir)
        return cls(hf, shape, tensors)

    def kv_pool(self, num_blocks: int, tokens_per_block: int) -> torch.Tensor:
        c = self.config
        return torch.zeros(1, 2, num_blocks, tokens_per_block, c.num_key_value_heads, c.head_size)

    def fuse(self, captured: torch.Tensor) -> torch.Tensor:
        """[T, 3 * target hidden] (the captured layers side by side, in id order) -> [T, hidden]."""
        return F.linear(captured.float(), self.fc)

    def _rms(self, x, weight):
        return self.ops.rms_norm(x, weight, self.eps)

    @torch.no_grad()
    def forward(self, inputs: dict, hidden: torch.Tensor, kv_cache: torch.Tensor):
        meta = StepMeta(*(inputs[k] for k in ("slot_mapping", "ctx_token_index", "ctx_block_tables",
                                              "ctx_context_lens", "gen_token_index", "gen_block_tables",
                                              "gen_context_lens")))
        tables = self.rotary(inputs["positions"], meta)
        embeds = F.embedding(inputs["input_ids"], self.embed)
        normed = self._rms(hidden, self.hidden_norm)
        residual = normed if self.shape.norm_before_residual else hidden
        x = torch.cat([self._rms(embeds, self.input_norm), normed], -1)
        attn = self.attention(F.linear(x, self.qkv), tables["global"], kv_cache, meta)
        residual = residual + F.linear(attn.flatten(1), self.o)
        gate_up = F.linear(self._rms(residual, self.post_norm), self.gate_up)
        prenorm = (residual + F.linear(self.ops.silu_and_mul(gate_up), self.down))[inputs["logits_index"]]
        logits = F.linear(self._rms(prenorm, self.norm), self.lm_head)
        return self.draft_to_target[logits.argmax(-1)], prenorm
