"""The decoder of every dense family (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm; Granite's
scalars, OLMo 2's post-norms, SmolLM3's NoPE layers, Phi-3, Gemma 2/3's sandwich norms, GeGLU and soft caps;
sliding windows per layer) and of the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE: kiln/models/moe.py)
on an op set (kiln/models/ops/).

One rank's model: it holds the layers of its pipeline stage and runs one engine step (DESIGN.md,
"The engine format") over a flat, unpadded token batch that mixes prefill chunks and decode tokens.
"""
import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import PretrainedConfig, torch_dtype
from kiln.models import lora, rope
from kiln.models.attention import make_attention
from kiln.models.linear import PackedLinear, packed_lm_head, tensor_specs
from kiln.models.moe import moe_tensor_specs
from kiln.models.ops.base import AttentionLayer, StepMeta
from kiln.models.ops.op_set import GROUPS, OpSet
from kiln.models.parallel import TensorParallel


class LlamaLayer(nn.Module):
    """One decoder layer; the family's choices (norm placement, window, rotary or not, q/k norms,
    soft cap, multipliers, LoRA modules) are its parts, picked here once."""

    def __init__(self, config: PretrainedConfig, weights: dict, index: int, rank: int, ops: OpSet,
                 tp: TensorParallel, kv_index: int, step: lora.StepLora | None):
        super().__init__()
        prefix = f"transformer.layers.{index}."

        def param(name, present=True):
            key = prefix + name
            if not present:
                return None
            if key not in weights:
                raise KeyError(f"missing tensor {key}")
            return nn.Parameter(norm_weight(config, weights[key]) if name.endswith("layernorm.weight")
                                else weights[key], requires_grad=False)

        def linear(names, columns, bias=None):
            """columns: (LoRA module, its first output column) of each part."""
            layer = ops.linear(config, weights, [prefix + n for n in names], bias)
            return lora.adapted(layer, kv_index, columns, step)

        H, KH, D = config.heads_per_rank, config.kv_heads_per_rank, config.head_size
        eps, multiplier = config.norm_epsilon, config.residual_multiplier
        # Norms a model does not have are None (config.pre_norm / post_norm).
        self.attn_input = ResidualNorm(ops, param("input_layernorm.weight", config.pre_norm), eps)
        self.attn_output = BlockOutput(ops, tp, param("post_attention_layernorm.weight", config.post_norm), eps,
                                       multiplier)
        self.mlp_input = ResidualNorm(ops, param("post_layernorm.weight", config.pre_norm), eps)
        self.mlp_output = BlockOutput(ops, tp, param("post_feedforward_layernorm.weight", config.post_norm), eps,
                                      multiplier)
        self.qkv = linear(["attention.qkv"], [("attn_q", 0), ("attn_k", H * D), ("attn_v", (H + KH) * D)],
                          bias=param("attention.qkv.bias", prefix + "attention.qkv.bias" in weights))
        self.dense = linear(["attention.dense"], [("attn_dense", 0)])
        window = config.window_of(index)
        spec = AttentionLayer(kv_index, H, KH, D, config.attention_multiplier or D ** -0.5, eps, window,
                              config.attn_logit_softcapping or 0.0, index not in config.nope_layers,
                              config.qk_layernorm_scope if config.qk_layernorm else None,
                              bool(config.quantization.kv_cache_quant_algo))
        kv_scale = (weights[prefix + "attention.kv_cache_scaling_factor"].float().reshape(())
                    if spec.quantized_kv else None)
        self.attention = make_attention(spec, ops, tp, config.num_attention_heads, config.num_key_value_heads,
                                        param("attention.q_layernorm.weight", config.qk_layernorm),
                                        param("attention.k_layernorm.weight", config.qk_layernorm), kv_scale)
        # Gemma 3's sliding layers rotate with a base of their own (rope.RotaryTables)
        self.rope = "local" if window and config.rotary_base_local is not None else "global"
        if config.is_moe_layer(index):
            self.mlp = ops.moe(config, weights, prefix, rank)
        else:
            # fc (activated) and gate as one GEMM: one pass over the activations instead of two
            gate_up = linear(["mlp.fc", "mlp.gate"], [("mlp_h_to_4h", 0), ("mlp_gate", config.intermediate_size
                                                                           // config.mapping.tp_size)])
            self.mlp = gated_mlp(gate_up, linear(["mlp.proj"], [("mlp_4h_to_h", 0)]),
                                 ops.act_and_mul(config.hidden_act), config.hidden_act)

    def forward(self, hidden, residual, kv_cache, meta: StepMeta, rope_tables: dict):
        x, residual = self.attn_input(hidden, residual)
        attn = self.attention(self.qkv(x), rope_tables[self.rope], kv_cache, meta)
        hidden = self.attn_output(self.dense(attn.flatten(1)))
        x, residual = self.mlp_input(hidden, residual)
        return self.mlp_output(self.mlp(x)), residual


class ResidualNorm(nn.Module):
    """The residual stream with the last block's output added, and what the next block reads: the
    stream normed (pre-norm models), or, without a weight (OLMo 2's post-norms only), the stream itself."""

    def __init__(self, ops: OpSet, weight, eps: float):
        super().__init__()
        self.ops, self.weight, self.eps = ops, weight, eps

    def forward(self, hidden, residual):
        if self.weight is None:
            residual = hidden if residual is None else hidden + residual
            return residual, residual
        if residual is None:  # the first layer
            return self.ops.rms_norm(hidden, self.weight, self.eps), hidden
        return self.ops.fused_add_rms_norm(hidden, residual, self.weight, self.eps)


class BlockOutput(nn.Module):
    """A block's row-parallel output summed over the ranks, normed where the model post-norms it
    (OLMo 2, Gemma), scaled where it has a residual multiplier (Granite)."""

    def __init__(self, ops: OpSet, tp: TensorParallel, weight, eps: float, multiplier: float):
        super().__init__()
        self.ops, self.tp, self.weight, self.eps, self.multiplier = ops, tp, weight, eps, multiplier

    def forward(self, out):
        out = self.tp.all_reduce(out)
        if self.weight is not None:
            out = self.ops.rms_norm(out, self.weight, self.eps)
        return out if self.multiplier == 1 else out * self.multiplier


class GatedMLP(nn.Module):
    def __init__(self, gate_up, proj, act_and_mul):
        super().__init__()
        self.gate_up, self.proj, self.act_and_mul = gate_up, proj, act_and_mul

    def forward(self, x):
        return self.proj(self.act_and_mul(self.gate_up(x)))


class FusedSwigluMLP(GatedMLP):
    """SiLU applied in the [gate; up] GEMM's epilogue (kiln_cpp::gemm_swiglu)."""

    def forward(self, x):
        return self.proj(self.gate_up.forward_swiglu(x))


def gated_mlp(gate_up, proj, act_and_mul, hidden_act: str) -> GatedMLP:
    fused = isinstance(gate_up, PackedLinear) and hidden_act == "silu"  # not under LoRA: it adds before SiLU
    gate_up.swiglu = fused  # engine-build times its kernels as they will run
    return (FusedSwigluMLP if fused else GatedMLP)(gate_up, proj, act_and_mul)


def norm_weight(config: PretrainedConfig, weight: torch.Tensor) -> torch.Tensor:
    """What an RMSNorm multiplies by: its weight, or (Gemma) 1 + weight in float32, as HF computes it."""
    return weight if not config.norm_weight_offset else weight.float() + config.norm_weight_offset


class Embedding(nn.Module):
    """The first stage's input: input_ids looked up in this rank's vocabulary slice (or, tied to a
    packed lm_head, read out of its table: one copy, not two), or embeddings given whole."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel, table=None, head: PackedLinear | None = None):
        super().__init__()
        self.config, self.tp, self.table, self.head = config, tp, table, head

    def lookup(self, ids):
        if self.head is None:
            return F.embedding(ids, self.table)
        return self.head.rows(ids, torch_dtype(self.config.dtype))

    def forward(self, input_ids, hidden_states=None, inputs_embeds=None):
        hidden = self.tp.embedding(self.lookup, input_ids) if inputs_embeds is None else inputs_embeds
        m = self.config.embedding_multiplier
        return hidden if m == 1 else hidden * m


class StageInput(nn.Module):
    """A later pipeline stage's input: the previous stage's hidden states."""

    def forward(self, input_ids, hidden_states=None, inputs_embeds=None):
        return hidden_states


class LogitsHead(nn.Module):
    """The last stage's output: only the selected tokens through the final norm and the vocab GEMM,
    scaled (Granite) and soft-capped (Gemma 2) as the model asks, gathered over the ranks."""

    def __init__(self, config: PretrainedConfig, ops: OpSet, tp: TensorParallel, ln_f, lm_head):
        super().__init__()
        self.config, self.ops, self.tp, self.ln_f, self.lm_head = config, ops, tp, ln_f, lm_head

    def forward(self, hidden, residual, logits_index):
        c = self.config
        hidden = self.ops.rms_norm((hidden + residual)[logits_index], self.ln_f, c.norm_epsilon)
        if isinstance(self.lm_head, PackedLinear):
            logits = self.lm_head(hidden)
        else:
            logits = F.linear(hidden, self.lm_head).float()
        if c.logits_scaling != 1:
            logits = logits / c.logits_scaling
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return self.tp.gather_logits(logits)[:, : c.vocab_size]


class StageOutput(nn.Module):
    """An earlier pipeline stage's output: the residual stream, which the next stage continues."""

    def forward(self, hidden, residual, logits_index):
        return hidden + residual


class LlamaForCausalLM(nn.Module):
    """Rank `rank` of the checkpoint's mapping: its pipeline stage's layers, its tensor-parallel
    share of each (kiln/models/parallel.py), on the kernels of `ops` (kiln/models/ops/).
    quantize_lm_head: "none", "int8" or "int4", the vocab GEMM's weight quantized at build
    (--quantize_lm_head); lora_modules: the LoRA target modules of the engine (TensorRT-LLM's names);
    hidden_state_layers: layers whose output (the residual stream after them) the forward returns
    beside the logits, {"layers.{i}": [T, hidden]}, for a draft model that reads them."""

    def __init__(self, config: PretrainedConfig, weights: dict, rank: int = 0, ops: OpSet | None = None,
                 quantize_lm_head: str = "none", lora_modules=(), hidden_state_layers=()):
        super().__init__()
        ops = ops or OpSet(dict.fromkeys(GROUPS, "inline"))  # the plain-torch reference
        self.config, self.ops = config, ops
        self.tp = tp = TensorParallel(config, rank)
        pp_rank = config.mapping.pp_rank(rank)
        self.layer_ids = list(config.layers_of(pp_rank))
        self.capture = {self.layer_ids.index(i): f"layers.{i}" for i in hidden_state_layers if i in self.layer_ids}
        self.lora = lora.StepLora(lora_modules) if lora_modules else None
        self.layers = nn.ModuleList(LlamaLayer(config, weights, i, rank, ops, tp, k, self.lora)
                                    for k, i in enumerate(self.layer_ids))
        self.rotary = rope.RotaryTables(config)
        table = None
        if pp_rank == 0:
            table = nn.Parameter(weights["transformer.vocab_embedding.weight"], requires_grad=False)
            self.embed = Embedding(config, tp, table)
        else:
            self.embed = StageInput()
        if pp_rank == config.mapping.pp_size - 1:
            ln_f = nn.Parameter(norm_weight(config, weights["transformer.ln_f.weight"]), requires_grad=False)
            self.head = LogitsHead(config, ops, tp, ln_f, self._lm_head(weights["lm_head.weight"], table,
                                                                        quantize_lm_head))
        else:
            self.head = StageOutput()

    def _lm_head(self, weight: torch.Tensor, table, quantize: str):
        tied = self.config.tie_word_embeddings and table is not None and torch.equal(weight, table)
        if self.ops.packed_gemm:
            head = packed_lm_head(self.config, weight, quantize)
            if tied:  # embedding rows are read out of the packed (maybe quantized) table: one copy, not two
                self.embed = Embedding(self.config, self.tp, head=head)
            return head
        return table if tied else nn.Parameter(weight, requires_grad=False)  # tied: one copy of the table

    def forward(self, input_ids, positions, slot_mapping, ctx_token_index, ctx_block_tables,
                ctx_context_lens, gen_token_index, gen_block_tables, gen_context_lens, logits_index,
                kv_cache, hidden_states=None, sequence_lens=None, lora_slots=None, lora_ranks=None, lora_pools=None,
                inputs_embeds=None):
        meta = StepMeta(slot_mapping, ctx_token_index, ctx_block_tables, ctx_context_lens, gen_token_index,
                        gen_block_tables, gen_context_lens)
        if self.lora is not None:
            self.lora.adapters = self.ops.lora(lora_slots, lora_ranks, lora_pools)
        rope_tables = self.rotary(positions, meta, sequence_lens)
        hidden, residual, captured = self.embed(input_ids, hidden_states, inputs_embeds), None, {}
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, kv_cache, meta, rope_tables)
            if i in self.capture:
                captured[self.capture[i]] = hidden + residual
        out = self.head(hidden, residual, logits_index)
        return (out, captured) if self.capture else out


def checkpoint_shapes(config: PretrainedConfig, rank: int) -> dict[str, tuple[int, ...]]:
    """Every tensor name a rank's checkpoint file must hold, with its shape."""
    return {name: shape for name, (shape, _) in checkpoint_tensors(config, rank).items()}


def checkpoint_tensors(config: PretrainedConfig, rank: int,
                       optional: bool = False) -> dict[str, tuple[tuple[int, ...], object]]:
    """Every tensor name a rank's checkpoint file must hold -> (shape, kind): kinds as in
    kiln.models.linear ("model", "scale", "int4" or an exact dtype); optional: with those it may hold
    (kiln.models.linear.Spec)."""
    m = config.mapping
    pp_rank = m.pp_rank(rank)
    hidden, D = config.hidden_size, config.head_size
    inter = config.intermediate_size // m.tp_size
    qkv_out = (config.heads_per_rank + 2 * config.kv_heads_per_rank) * D
    model = "model"
    specs = {}
    if pp_rank == 0:
        specs["transformer.vocab_embedding.weight"] = ((config.vocab_size_padded // m.tp_size, hidden), model)
    for i in config.layers_of(pp_rank):
        p = f"transformer.layers.{i}."
        norms = (("input_layernorm", "post_layernorm") if config.pre_norm else ()) + (
            ("post_attention_layernorm", "post_feedforward_layernorm") if config.post_norm else ())
        specs.update({p + n + ".weight": ((hidden,), model) for n in norms})
        linears = [("attention.qkv", qkv_out, hidden), ("attention.dense", hidden, config.heads_per_rank * D)]
        if config.is_moe_layer(i):
            specs.update(moe_tensor_specs(config, p, rank, optional))
        else:
            linears += [("mlp.fc", inter, hidden), ("mlp.gate", inter, hidden), ("mlp.proj", hidden, inter)]
        for name, out, inp in linears:
            specs.update(tensor_specs(config, p + name, out, inp, optional))
        if config.attn_bias:
            specs[p + "attention.qkv.bias"] = ((qkv_out,), model)
        if config.qk_layernorm:
            whole = config.qk_layernorm_scope == "projection"  # the rank's heads' share of the weight
            specs[p + "attention.q_layernorm.weight"] = ((config.heads_per_rank * D if whole else D,), model)
            specs[p + "attention.k_layernorm.weight"] = ((config.kv_heads_per_rank * D if whole else D,), model)
        if config.quantization.kv_cache_quant_algo:
            specs[p + "attention.kv_cache_scaling_factor"] = ((1,), "scale")
    if pp_rank == m.pp_size - 1:
        specs["transformer.ln_f.weight"] = ((hidden,), model)
        specs["lm_head.weight"] = ((config.vocab_size_padded // m.tp_size, hidden), model)
    return specs
