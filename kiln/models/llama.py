"""The decoder of every dense family (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm; Granite's
scalars, OLMo 2's post-norms, SmolLM3's NoPE layers, Phi-3, Gemma 2/3's sandwich norms, GeGLU and soft caps;
sliding windows per layer) and of the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE: kiln/models/moe.py)
on kiln plugins.

One rank's model: it holds the layers of its pipeline stage and runs one engine step (DESIGN.md,
"The engine format") over a flat, unpadded token batch that mixes prefill chunks and decode tokens.
"""
import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ELEMENTWISE_PLUGINS, PretrainedConfig, torch_dtype
from kiln.models import lora, rope
from kiln.models.linear import PackedLinear, make_linear, packed_lm_head, tensor_specs
from kiln.models.moe import MoeMLP, moe_tensor_specs
from kiln.models.parallel import TensorParallel
from kiln.plugins import cpu, gemm, ops

class _Ops:
    """Picks, per op, the plugin (a custom-op node the backend maps to its kernel) or the inline CPU
    path (traced into the graph, where the compiler fuses it and no call leaves compiled code)."""

    def __init__(self, plugin_config: dict):
        def pick(key, name):
            choice = plugin_config.get(key)
            if choice == "cpp" and key in ELEMENTWISE_PLUGINS:  # kiln/plugins/csrc/elementwise.cpp
                from kiln.plugins import cpp

                return cpp.op(name)
            return getattr(ops if choice not in (None, "inline") else cpu, name)

        self.rms_norm = pick("rmsnorm_plugin", "rms_norm")
        self.fused_add_rms_norm = pick("rmsnorm_plugin", "fused_add_rms_norm")
        self.rotary_embedding = pick("rope_plugin", "rotary_embedding")
        self.silu_and_mul = pick("swiglu_plugin", "silu_and_mul")
        self.kv_cache_write = pick("gpt_attention_plugin", "kv_cache_write")
        self.paged_attention = pick("gpt_attention_plugin", "paged_attention")
        self.attention = None
        if plugin_config.get("gpt_attention_plugin") == "cpp":
            # The C++ plugin (kiln/plugins/csrc): a kiln_cpp:: node AOTInductor calls without Python.
            # The KV write stays inline: one index_put_ on the pool, compiled in place.
            from kiln.plugins import cpp

            self.kv_cache_write = cpu.kv_cache_write
            self.paged_attention = cpp.paged_attention_op()
            # Norms, rope, KV write and attention of a layer in one call (kiln/plugins/csrc/attention.cpp)
            self.attention = cpp.op("attention")


class LlamaLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, weights: dict, index: int, rank: int, packed: bool = False):
        super().__init__()
        prefix = f"transformer.layers.{index}."

        def param(name, optional=False):
            key = prefix + name
            if key not in weights:
                if optional:
                    return None
                raise KeyError(f"missing tensor {key}")
            return nn.Parameter(norm_weight(config, weights[key]) if name.endswith("layernorm.weight")
                                else weights[key], requires_grad=False)

        def linear(*names, bias=None):
            return make_linear(config, weights, [prefix + n for n in names], bias, packed)

        # Norms a model does not have are None (config.pre_norm / post_norm).
        self.input_layernorm = param("input_layernorm.weight", optional=not config.pre_norm)
        self.post_layernorm = param("post_layernorm.weight", optional=not config.pre_norm)
        self.post_attention_layernorm = param("post_attention_layernorm.weight", optional=not config.post_norm)
        self.post_feedforward_layernorm = param("post_feedforward_layernorm.weight", optional=not config.post_norm)
        self.qkv = linear("attention.qkv", bias=param("attention.qkv.bias", optional=True))
        self.q_layernorm = param("attention.q_layernorm.weight", optional=not config.qk_layernorm)
        self.k_layernorm = param("attention.k_layernorm.weight", optional=not config.qk_layernorm)
        self.dense = linear("attention.dense")
        self.rotary = index not in config.nope_layers
        self.window = config.window_of(index)
        self.moe = self.gate_up = self.proj = None
        if config.is_moe_layer(index):
            self.moe = MoeMLP(config, weights, prefix, rank, packed)
        else:
            # fc (activated) and gate as one GEMM: one pass over the activations instead of two;
            # on the plugin, with SiLU applied in the same call (gemm_swiglu) unless LoRA adds to it.
            self.gate_up = linear("mlp.fc", "mlp.gate")
            self.proj = linear("mlp.proj")
            self.gate_up.swiglu = isinstance(self.gate_up, PackedLinear) and config.hidden_act == "silu"

    def mlp(self, x, act_and_mul, adapt=None):
        """adapt(out, inp, (module, column), ...): out plus those modules' LoRA updates (LoRA engines)."""
        if self.moe is not None:
            return self.moe(x, act_and_mul)
        if adapt is None and self.gate_up.swiglu:
            return self.proj(self.gate_up.forward_swiglu(x))
        up = self.gate_up(x)
        if adapt is None:
            return self.proj(act_and_mul(up))
        up = adapt(up, x, ("mlp_h_to_4h", 0), ("mlp_gate", up.shape[-1] // 2))
        h = act_and_mul(up)
        return adapt(self.proj(h), h, ("mlp_4h_to_h", 0))


def norm_weight(config: PretrainedConfig, weight: torch.Tensor) -> torch.Tensor:
    """What an RMSNorm multiplies by: its weight, or (Gemma) 1 + weight in float32, as HF computes it."""
    return weight if not config.norm_weight_offset else weight.float() + config.norm_weight_offset


class LlamaForCausalLM(nn.Module):
    """Rank `rank` of the checkpoint's mapping: its pipeline stage's layers, its tensor-parallel
    share of each (kiln/models/parallel.py). The first stage embeds input_ids, later ones continue
    from hidden_states; the last stage returns logits, earlier ones the hidden states for the next.
    quantize_lm_head: "none", "int8" or "int4", the vocab GEMM's weight quantized at build (--quantize_lm_head)."""

    def __init__(self, config: PretrainedConfig, weights: dict, rank: int = 0, plugin_config: dict | None = None,
                 quantize_lm_head: str = "none"):
        super().__init__()
        self.config = config
        self.ops = _Ops(plugin_config or {})
        self.tp = TensorParallel(config, rank)
        # gemm_plugin "cpp": every GEMM on the C++ plugin, weights packed in its panel layout.
        self.packed = (plugin_config or {}).get("gemm_plugin") == "cpp"
        pp_rank = config.mapping.pp_rank(rank)
        self.layer_ids = list(config.layers_of(pp_rank))
        self.is_first = pp_rank == 0
        self.is_last = pp_rank == config.mapping.pp_size - 1
        self.num_heads = config.heads_per_rank
        self.num_kv_heads = config.kv_heads_per_rank
        self.head_size = config.head_size
        self.eps = config.norm_epsilon
        self.scale = config.attention_multiplier or config.head_size ** -0.5
        self.vocab_embedding = self.lm_head = self.ln_f = None
        if self.is_first:
            self.vocab_embedding = nn.Parameter(weights["transformer.vocab_embedding.weight"], requires_grad=False)
        self.layers = nn.ModuleList(
            LlamaLayer(config, weights, i, rank, self.packed) for i in self.layer_ids)
        if self.is_last:
            self._init_head(weights, quantize_lm_head)
        self.register_buffer("inv_freq", rope.inv_freq(config), persistent=False)
        self.register_buffer("inv_freq_long", rope.inv_freq(config, long=True) if config.long_rope_threshold else None,
                             persistent=False)
        # Gemma 3: sliding layers rotate with a base of their own, unscaled
        self.local_rope = None if config.rotary_base_local is None else dataclasses.replace(
            config, rotary_base=config.rotary_base_local, rotary_scaling=None)
        self.register_buffer("inv_freq_local", None if self.local_rope is None else rope.inv_freq(self.local_rope),
                             persistent=False)
        # GeGLU (Gemma) is traced inline: the elementwise plugin has SwiGLU only
        self.act_and_mul = cpu.gelu_tanh_and_mul if config.hidden_act == "gelu_pytorch_tanh" else self.ops.silu_and_mul
        # Static per-layer scales of an 8-bit KV cache: the pool holds round/cast(x / scale).
        self.register_buffer("kv_scales", torch.cat([
            weights[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"].float().reshape(1)
            for i in self.layer_ids]) if config.quantization.kv_cache_quant_algo else None)

    def _init_head(self, weights: dict, quantize_lm_head: str) -> None:
        self.ln_f = nn.Parameter(norm_weight(self.config, weights["transformer.ln_f.weight"]), requires_grad=False)
        lm_head = weights["lm_head.weight"]
        tied = (self.config.tie_word_embeddings and self.vocab_embedding is not None
                and torch.equal(lm_head, self.vocab_embedding))
        self.vocab_rows = lm_head.shape[0]
        if self.packed:
            self.lm_head = packed_lm_head(self.config, lm_head, quantize_lm_head)
            if tied:  # embedding rows are read out of the packed (maybe quantized) table: one copy, not two
                self.vocab_embedding = None
        elif tied:
            self.lm_head = self.vocab_embedding  # one copy of the table in the engine, not two
        else:
            self.lm_head = nn.Parameter(lm_head, requires_grad=False)

    def _embed(self, input_ids):
        if self.vocab_embedding is None:  # tied to the packed lm_head
            head, dtype = self.lm_head, torch_dtype(self.config.dtype)
            return self.tp.embedding(lambda ids: gemm.embedding(
                head.weight, ids, self.vocab_rows, self.config.hidden_size, head.scale, head.group_size, dtype),
                input_ids)
        return self.tp.embedding(lambda ids: F.embedding(ids, self.vocab_embedding), input_ids)

    def forward(self, input_ids, positions, slot_mapping, ctx_token_index, ctx_block_tables,
                ctx_context_lens, gen_token_index, gen_block_tables, gen_context_lens, logits_index,
                kv_cache, hidden_states=None, sequence_lens=None, lora_slots=None, lora_ranks=None, lora_pools=None):
        o, T = self.ops, input_ids.shape[0]
        H, KH, D = self.num_heads, self.num_kv_heads, self.head_size
        rope_lens = None
        if (self.config.rotary_scaling or {}).get("type") == "dynamic":
            rope_lens = _rope_lens(positions, ctx_token_index, ctx_context_lens)
        cos, sin = rope.cos_sin(self.config, self.inv_freq, positions, rope_lens, self.inv_freq_long, sequence_lens)
        if self.local_rope is not None:
            cos_local, sin_local = rope.cos_sin(self.local_rope, self.inv_freq_local, positions)

        softcap = self.config.attn_logit_softcapping
        adapters = None if lora_slots is None else lora.StepAdapters(lora_slots, lora_ranks, lora_pools, self.packed)
        hidden = self._embed(input_ids) if self.is_first else hidden_states
        if self.is_first and self.config.embedding_multiplier != 1:
            hidden = hidden * self.config.embedding_multiplier

        def attend(i, layer, qkv, kv_scale):
            """Layer i's attention [T, H, D] from its QKV projection, writing its K/V to the pool."""
            cos_sin = (cos_local, sin_local) if layer.window and self.local_rope is not None else (cos, sin)
            if (o.attention is not None and layer.rotary and kv_scale is None
                    and (layer.q_layernorm is None or self.config.qk_layernorm_scope == "head")):
                # One kiln_cpp::attention call: a float pool, and q/k norms (if any) per head
                return o.attention(qkv, *cos_sin, kv_cache, i, slot_mapping, ctx_token_index, ctx_block_tables,
                                   ctx_context_lens, gen_token_index, gen_block_tables, gen_context_lens, H,
                                   self.scale, layer.q_layernorm, layer.k_layernorm, self.eps, layer.window,
                                   softcap or 0.0)
            q, k, v = qkv.split([H * D, KH * D, KH * D], dim=-1)
            if layer.q_layernorm is not None and self.config.qk_layernorm_scope == "projection":
                q = self._projection_norm(q, layer.q_layernorm, self.config.num_attention_heads)
                k = self._projection_norm(k, layer.k_layernorm, self.config.num_key_value_heads)
            q, k, v = q.view(T, H, D), k.view(T, KH, D), v.view(T, KH, D)
            if layer.q_layernorm is not None and self.config.qk_layernorm_scope == "head":
                q = o.rms_norm(q, layer.q_layernorm, self.eps)
                k = o.rms_norm(k, layer.k_layernorm, self.eps)
            if layer.rotary:
                q, k = o.rotary_embedding(q, k, *cos_sin)
            o.kv_cache_write(kv_cache, i, k, v, slot_mapping, kv_scale)
            return o.paged_attention(q, kv_cache, i, ctx_token_index, ctx_block_tables, ctx_context_lens,
                                     gen_token_index, gen_block_tables, gen_context_lens, self.scale,
                                     *(() if kv_scale is None else (kv_scale,)),
                                     **({"window": layer.window} if layer.window else {}),
                                     **({"softcap": softcap} if softcap else {}))

        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = self._block_input(hidden, residual, layer.input_layernorm)
            kv_scale = None if self.kv_scales is None else self.kv_scales[i]
            adapt = None if adapters is None else functools.partial(adapters, i)
            qkv = layer.qkv(x)
            if adapt is not None:
                qkv = adapt(qkv, x, ("attn_q", 0), ("attn_k", H * D), ("attn_v", (H + KH) * D))
            attn = attend(i, layer, qkv, kv_scale).reshape(T, H * D)
            out = layer.dense(attn)
            hidden = self._block_output(out if adapt is None else adapt(out, attn, ("attn_dense", 0)),
                                        layer.post_attention_layernorm)
            x, residual = self._block_input(hidden, residual, layer.post_layernorm)
            hidden = self._block_output(layer.mlp(x, self.act_and_mul, adapt), layer.post_feedforward_layernorm)

        if not self.is_last:  # the next stage starts from the residual stream, as a layer would
            return hidden + residual
        # Only the selected tokens go through the final norm and the vocab GEMM.
        hidden = (hidden + residual)[logits_index]
        hidden = o.rms_norm(hidden, self.ln_f, self.eps)
        if self.packed:
            logits = self.lm_head(hidden)
        else:
            logits = F.linear(hidden, self.lm_head).float()
        if self.config.logits_scaling != 1:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return self.tp.gather_logits(logits)[:, : self.config.vocab_size]

    def _block_input(self, hidden, residual, norm):
        """The residual stream with the last block's output added, and what the next block reads:
        the stream normed (pre-norm models) or the stream itself."""
        if norm is None:
            residual = hidden if residual is None else hidden + residual
            return residual, residual
        if residual is None:
            return self.ops.rms_norm(hidden, norm, self.eps), hidden
        return self.ops.fused_add_rms_norm(hidden, residual, norm, self.eps)

    def _block_output(self, out, norm):
        """A block's row-parallel output summed over the ranks, normed where the model post-norms it,
        scaled where it has a residual multiplier."""
        out = self.tp.all_reduce(out)
        if norm is not None:
            out = self.ops.rms_norm(out, norm, self.eps)
        return out if self.config.residual_multiplier == 1 else out * self.config.residual_multiplier

    def _projection_norm(self, x, weight, heads: int):
        """RMSNorm over a whole q or k projection of `heads` heads (OLMo 2), of which this rank holds
        its share: the sum of squares is summed over the ranks, a KV head that several ranks hold
        (tp > KV heads) counted once."""
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:
            squares = self.tp.all_reduce(squares) / max(1, self.tp.size // heads)
        return (weight * (xf * torch.rsqrt(squares / (heads * self.head_size) + self.eps))).to(x.dtype)


def _rope_lens(positions, ctx_token_index, ctx_context_lens):
    """Per token, the length its forward pass reaches: the chunk's end for context tokens, else pos + 1."""
    T = positions.shape[0]
    lens = torch.cat([positions + 1, positions.new_zeros(1)])
    index = torch.where(ctx_token_index >= 0, ctx_token_index, T).flatten()
    lens = lens.index_put((index,), ctx_context_lens[:, None].expand_as(ctx_token_index).flatten().to(lens.dtype))
    return lens[:T]


def checkpoint_shapes(config: PretrainedConfig, rank: int) -> dict[str, tuple[int, ...]]:
    """Every tensor name a rank's checkpoint file must hold, with its shape."""
    return {name: shape for name, (shape, _) in checkpoint_tensors(config, rank).items()}


def checkpoint_tensors(config: PretrainedConfig, rank: int) -> dict[str, tuple[tuple[int, ...], object]]:
    """Every tensor name a rank's checkpoint file must hold -> (shape, kind): kinds as in
    kiln.models.linear ("model", "scale", "int4" or an exact dtype)."""
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
            specs.update(moe_tensor_specs(config, p, rank))
        else:
            linears += [("mlp.fc", inter, hidden), ("mlp.gate", inter, hidden), ("mlp.proj", hidden, inter)]
        for name, out, inp in linears:
            specs.update(tensor_specs(config, p + name, out, inp))
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
