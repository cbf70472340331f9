"""Checkpoint and build configs, in TensorRT-LLM's unified-checkpoint JSON layout."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.version import __version__

DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "SmolLM3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
# The MLP's gate activation: SwiGLU, or GeGLU with the tanh approximation (Gemma).
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
QK_LAYERNORM_SCOPES = ("head", "projection")
# rotary_scaling.type -> the keys the rotary embedding cannot do without (kiln/models/rope.py).
ROPE_SCALING_TYPES = {"linear": ("factor",), "dynamic": ("factor",),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                      "yarn": (),
                      "longrope": ("short_factor", "long_factor", "original_max_position_embeddings",
                                   "attention_factor")}


class ConfigError(ValueError):
    """A config file or value that Kiln cannot use; the message names the field and what was expected."""


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; expected one of {', '.join(DTYPES)}")
    return getattr(torch, name)


@dataclass
class Mapping:
    """TensorRT-LLM's mapping. The tensor-parallel group also splits a mixture of experts' experts:
    moe_tp_size ranks share each expert (its intermediate dim split, as a dense MLP's) and moe_ep_size
    groups of them hold disjoint experts; tp_size = moe_tp_size * moe_ep_size. None: moe_tp_size =
    tp_size, moe_ep_size = 1 (TensorRT-LLM's default)."""
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    moe_tp_size: int | None = None
    moe_ep_size: int | None = None

    def __post_init__(self):
        for name in ("tp_size", "pp_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"mapping.{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size != self.tp_size * self.pp_size:
            raise ConfigError(
                f"mapping.world_size ({self.world_size}) must equal tp_size * pp_size "
                f"({self.tp_size} * {self.pp_size})"
            )
        if self.moe_tp_size is None and self.moe_ep_size is None:
            self.moe_tp_size, self.moe_ep_size = self.tp_size, 1
        elif self.moe_tp_size is None:
            self.moe_tp_size = self.tp_size // max(self.moe_ep_size, 1)
        elif self.moe_ep_size is None:
            self.moe_ep_size = self.tp_size // max(self.moe_tp_size, 1)
        if self.moe_tp_size < 1 or self.moe_ep_size < 1 or self.moe_tp_size * self.moe_ep_size != self.tp_size:
            raise ConfigError(f"mapping.moe_tp_size ({self.moe_tp_size}) * moe_ep_size ({self.moe_ep_size}) must "
                              f"equal tp_size ({self.tp_size})")

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp_size


@dataclass
class QuantConfig:
    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    group_size: int = 128
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: list[str] | None = None
    # Kiln's: the MLPs' intermediate channels are in an act-order down_proj's group order (a GPTQ
    # desc_act checkpoint split over tp ranks: gate/up rows permuted to match), which LoRA adapters are not
    mlp_channels_by_group: bool = False


# TensorRT-LLM's MoeConfig.ExpertScaleNormalizationMode: the top-k routing weights as they are (NONE)
# or divided by their sum (RENORMALIZE); the router's softmax is over all experts either way.
MOE_NORMALIZATION_MODES = {0: "none", 1: "renormalize"}


@dataclass
class MoeConfig:
    """TensorRT-LLM's `moe` section: num_experts 0 is a dense model."""
    num_experts: int = 0
    top_k: int = 0
    normalization_mode: int = 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none), gated by a sigmoid

    def __post_init__(self):
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.top_k <= self.num_experts):
            raise ConfigError(f"moe.top_k ({self.top_k}) must be in 1 .. moe.num_experts ({self.num_experts})")
        if self.normalization_mode not in MOE_NORMALIZATION_MODES:
            raise ConfigError(f"moe.normalization_mode {self.normalization_mode} is not supported; expected one of "
                              + ", ".join(f"{k} ({v})" for k, v in MOE_NORMALIZATION_MODES.items()))


@dataclass
class PretrainedConfig:
    architecture: str
    dtype: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    intermediate_size: int
    max_position_embeddings: int
    hidden_act: str = "silu"
    norm_epsilon: float = 1e-6
    position_embedding_type: str = "rope_gpt_neox"
    rotary_base: float = 10000.0
    rotary_scaling: dict | None = None
    # The first head_size * partial_rotary_factor dims of each q/k head rotate, the rest pass (Phi-4-mini).
    partial_rotary_factor: float = 1.0
    attn_bias: bool = False
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False
    use_parallel_embedding: bool = True
    embedding_sharding_dim: int = 0
    logits_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    mapping: Mapping = field(default_factory=Mapping)
    quantization: QuantConfig = field(default_factory=QuantConfig)
    # Mixture of experts: every layer's MLP is one unless mlp_only_layers names it or (i + 1) is not
    # a multiple of decoder_sparse_step (Qwen2-MoE's keys); experts are moe_intermediate_size wide.
    moe: MoeConfig = field(default_factory=MoeConfig)
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # Where each block's RMSNorm sits. pre_norm: input_layernorm before attention and post_layernorm
    # before the MLP (Llama). post_norm: post_attention_layernorm on the attention's output and
    # post_feedforward_layernorm on the MLP's, before each residual add (OLMo 2).
    pre_norm: bool = True
    post_norm: bool = False
    # q/k RMSNorm over each head (Qwen3) or over the whole projection, every head at once (OLMo 2).
    qk_layernorm_scope: str = "head"
    # Layers that attend without rotary embedding (SmolLM3's NoPE layers).
    nope_layers: list[int] = field(default_factory=list)
    # Sliding-window attention: a layer of sliding_window_layers (None: every layer) sees the last
    # sliding_window keys up to its query (None: no window anywhere).
    sliding_window: int | None = None
    sliding_window_layers: list[int] | None = None
    # Gemma: sliding layers rotate with their own base (Gemma 3; no scaling; None: the global
    # rotary_base and rotary_scaling everywhere); RMSNorms multiply by norm_weight_offset + weight, in
    # float32; the logits pass through tanh(logits / cap) * cap (None: not capped).
    rotary_base_local: float | None = None
    norm_weight_offset: float = 0.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: every score through tanh(s / cap) * cap
    # Granite's scalars: the embedding's output, each block's output before its residual add and the
    # attention scores (None: head_size ** -0.5) are multiplied, the logits divided.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; expected one of "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        torch_dtype(self.dtype)
        if self.hidden_act not in HIDDEN_ACTS or (self.moe.num_experts and self.hidden_act != "silu"):
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; expected one of "
                              f"{', '.join(HIDDEN_ACTS[:1] if self.moe.num_experts else HIDDEN_ACTS)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not (self.pre_norm or self.post_norm):
            raise ConfigError("pre_norm and post_norm are both false; expected at least one (where the blocks' "
                              "RMSNorms sit)")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ConfigError(f"sliding_window {self.sliding_window!r} is not supported; expected null or an "
                              f"integer >= 1")
        if self.qk_layernorm_scope not in QK_LAYERNORM_SCOPES:
            raise ConfigError(f"qk_layernorm_scope {self.qk_layernorm_scope!r} is not supported; expected one of "
                              f"{', '.join(QK_LAYERNORM_SCOPES)}")
        if self.rotary_scaling is not None:
            kind = self.rotary_scaling.get("type")
            if kind not in ROPE_SCALING_TYPES:
                raise ConfigError(
                    f"rotary_scaling.type {kind!r} is not supported; expected one of "
                    f"{', '.join(ROPE_SCALING_TYPES)}"
                )
            missing = [k for k in ROPE_SCALING_TYPES[kind] if self.rotary_scaling.get(k) is None]
            if missing:
                raise ConfigError(f"rotary_scaling ({kind}) is missing {', '.join(missing)}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} is not supported; expected a "
                              f"factor in (0, 1] giving an even number of rotary dims (head_size {self.head_size})")
        if self.long_rope_threshold:
            for key in ("short_factor", "long_factor"):
                if len(self.rotary_scaling[key]) != self.rotary_dim // 2:
                    raise ConfigError(f"rotary_scaling.{key} has {len(self.rotary_scaling[key])} factors; expected "
                                      f"{self.rotary_dim // 2} (one per pair of the {self.rotary_dim} rotary dims)")
        tp = self.mapping.tp_size
        if self.num_attention_heads % tp:
            raise ConfigError(
                f"tp_size {tp} does not divide num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_key_value_heads % tp and tp % self.num_key_value_heads:
            raise ConfigError(
                f"tp_size {tp} and num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"one another"
            )
        dense = any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        if dense and self.intermediate_size % tp:
            raise ConfigError(
                f"tp_size {tp} does not divide intermediate_size ({self.intermediate_size})"
            )
        if self.moe.num_experts:
            m = self.mapping
            if self.moe.num_experts % m.moe_ep_size:
                raise ConfigError(f"moe_ep_size {m.moe_ep_size} does not divide moe.num_experts "
                                  f"({self.moe.num_experts})")
            shared = self.moe.shared_expert_intermediate_size
            for flag, split, name, size in (("moe_tp_size", m.moe_tp_size, "moe_intermediate_size",
                                             self.moe_intermediate_size),
                                            ("tp_size", m.tp_size, "moe.shared_expert_intermediate_size", shared)):
                if size % split:
                    raise ConfigError(f"{flag} {split} does not divide {name} ({size})")
            if self.decoder_sparse_step < 1:
                raise ConfigError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.num_hidden_layers < self.mapping.pp_size:
            raise ConfigError(
                f"pp_size {self.mapping.pp_size} exceeds num_hidden_layers ({self.num_hidden_layers})"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def long_rope_threshold(self) -> int:
        """LongRoPE: a sequence longer than this rotates q and k with the long factors (0: no LongRoPE)."""
        scaling = self.rotary_scaling or {}
        return scaling["original_max_position_embeddings"] if scaling.get("type") == "longrope" else 0

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_key_value_heads // self.mapping.tp_size)

    @property
    def heads_per_rank(self) -> int:
        return self.num_attention_heads // self.mapping.tp_size

    @property
    def vocab_size_padded(self) -> int:
        tp = self.mapping.tp_size
        return -(-self.vocab_size // tp) * tp

    def is_moe_layer(self, i: int) -> bool:
        return (self.moe.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def window_of(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 where it attends to every key before its query."""
        if self.sliding_window is None:
            return 0
        layers = self.sliding_window_layers
        return self.sliding_window if layers is None or layer in layers else 0

    @property
    def kv_window(self) -> int:
        """The window every layer slides (KV blocks behind it are never read again), else 0."""
        windows = {self.window_of(i) for i in range(self.num_hidden_layers)}
        return 0 if 0 in windows else max(windows)

    @property
    def experts_per_rank(self) -> int:
        return self.moe.num_experts // self.mapping.moe_ep_size

    def parameter_counts(self) -> tuple[int, int]:
        """(parameters, parameters a token is computed with): a mixture of experts runs top_k experts."""
        h, d, q, kv = self.hidden_size, self.head_size, self.num_attention_heads, self.num_key_value_heads
        attention = h * d * (2 * q + 2 * kv) + 2 * h + (d * (q + 2 * kv) if self.attn_bias else 0)
        total = active = self.num_hidden_layers * attention
        for i in range(self.num_hidden_layers):
            if not self.is_moe_layer(i):
                total, active = total + 3 * h * self.intermediate_size, active + 3 * h * self.intermediate_size
                continue
            expert, shared = 3 * h * self.moe_intermediate_size, 3 * h * self.moe.shared_expert_intermediate_size
            router = h * self.moe.num_experts + (h if shared else 0)
            total += router + shared + self.moe.num_experts * expert
            active += router + shared + self.moe.top_k * expert
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        return total + embeddings, active + embeddings

    def layers_of(self, pp_rank: int) -> range:
        """Layers held by a pipeline stage: an even split, earlier stages taking the remainder."""
        n, pp = self.num_hidden_layers, self.mapping.pp_size
        base, extra = divmod(n, pp)
        start = pp_rank * base + min(pp_rank, extra)
        return range(start, start + base + (1 if pp_rank < extra else 0))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PretrainedConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"checkpoint config must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        # ModelOpt's export (TensorRT-LLM's names): `bias` is the qkv bias; `share_embedding_table`
        # says lm_head is the embedding table; rotary_scaling keeps HF's "rope_type" key.
        if "attn_bias" not in d and "bias" in d:
            d["attn_bias"] = bool(d["bias"])
        if "tie_word_embeddings" not in d and "share_embedding_table" in d:
            d["tie_word_embeddings"] = bool(d["share_embedding_table"])
        scaling = d.get("rotary_scaling")
        if isinstance(scaling, dict) and "type" not in scaling and "rope_type" in scaling:
            d["rotary_scaling"] = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and f.name not in d]
        if missing:
            raise ConfigError(f"checkpoint config is missing field(s): {', '.join(missing)}")
        # TensorRT-LLM/ModelOpt write more mapping keys (cp_size, ...); ours are derived from these.
        mapping = d.get("mapping") or {}
        d["mapping"] = Mapping(**{k: mapping[k] for k in ("world_size", "tp_size", "pp_size", "moe_tp_size",
                                                          "moe_ep_size") if k in mapping})
        moe = d.get("moe") or {}
        d["moe"] = MoeConfig(**{k: v for k, v in moe.items() if k in {f.name for f in dataclasses.fields(MoeConfig)}})
        d["quantization"] = QuantConfig(**{k: v for k, v in (d.get("quantization") or {}).items()
                                           if k in {f.name for f in dataclasses.fields(QuantConfig)}})
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> "PretrainedConfig":
        path = Path(checkpoint_dir) / "config.json"
        d = read_json(path)
        try:
            return cls.from_dict(d)
        except ConfigError as e:  # name the file: "architecture 'X' is not supported" alone does not
            raise ConfigError(f"{path}: {e}") from None


BACKENDS = ("aoti", "eager")
KERNELS = ("cpu", "triton")
# The elementwise plugins of the step, in TensorRT-LLM's plugin_config names.
ELEMENTWISE_PLUGINS = ("rmsnorm_plugin", "rope_plugin", "swiglu_plugin")


@dataclass
class BuildConfig:
    max_batch_size: int = 8
    max_input_len: int = 512
    # None: the model's max_position_embeddings (times its rope factor), as trtllm-build deduces it
    # (kiln.build.builder.resolve_max_seq_len).
    max_seq_len: int | None = None
    max_num_tokens: int = 1024
    tokens_per_block: int = 32
    # The widest beam search a request may ask for (TensorRT-LLM's flag and default); each beam is a
    # sequence of the batch, so nothing compiled depends on it.
    max_beam_width: int = 1
    kv_cache_dtype: str | None = None  # None: the model's dtype
    backend: str = "aoti"
    max_autotune: bool | None = None  # None: on where it pays (aoti with bf16/fp16 weights)
    # TensorRT-LLM's names. None or "inline": trace the op inline for the backend's compiler to fuse
    # (fastest under AOTInductor on CPU); "python": keep it a kiln:: plugin node in the graph. For
    # gpt_attention_plugin, "cpp": the C++ paged-attention op (torch.ops.kiln_cpp, kiln/plugins/cpp.py),
    # which reads the KV pages in place and runs in AOTInductor packages without Python; None there
    # lets the builder choose (cpp for aoti, else inline). gemm_plugin
    # "cpp": every linear on the C++ GEMM op (kiln/plugins/gemm.py: packed, possibly quantized weights);
    # None lets the builder choose (cpp for aoti with bf16/fp16 or quantized weights, else inline).
    # rmsnorm/rope/swiglu_plugin "cpp": kiln_cpp's elementwise ops on the kernels' thread pool; None
    # lets the builder choose (cpp where both plugins above are cpp, else inline). TensorRT-LLM's values
    # are taken with its meaning (kiln.build.builder.resolve_plugins): "auto" or a dtype turn a
    # plugin on (cpp), "disable" off (inline).
    plugin_config: dict = field(default_factory=lambda: {
        "gpt_attention_plugin": None, "gemm_plugin": None, "rmsnorm_plugin": None, "rope_plugin": None,
        "swiglu_plugin": None,
    })
    # Written by engine-build: the kernel family of each group of the model's ops, as the plugin
    # settings resolved (kiln.models.ops.op_set: {"attention": "cpp", "gemm": "cpp", ...}).
    op_set: dict | None = None
    # gemm_plugin "cpp": time every GEMM kernel per GEMM and token bucket at build (kiln.plugins.tactics)
    # and keep the winners; timing_cache: a JSON file of measurements reused across builds.
    tactic_timing: bool = True
    timing_cache: str | None = None
    # int8 and int4 weights' GEMMs may quantize activations to int8 (per 128 k, or int4's group) where that times
    # faster, as llama.cpp's and ORT GenAI's int4/int8 CPU paths do by default: batch-1 decode then
    # reads int4 weights at ~1.6x the float-activation kernel's speed (AVX2). On by default: its
    # measured perplexity cost is within a tenth of a percent (benchmarks/quant.py --int8_activations).
    # False: W8A16/W4A16 as the format specifies.
    int8_activations: bool = True
    # The lm_head RTN-quantized at build: "int8" (per row), "int4" (per group), "none", or None for
    # the builder's choice (kiln.build.settings.lm_head_quantization: int8 for int8/int4 weight-only
    # checkpoints). A tied embedding reads its rows out of the same table. (True / False: engines
    # built before, meaning the checkpoint's width / none.)
    quantize_lm_head: str | bool | None = None
    # Written by engine-build: the tactic table (per GEMM and bucket: the winner and every candidate's
    # microseconds), the CPU features its kernels need, and the CPU it was timed on.
    gemm_tactics: dict | None = None
    cpu_features: list | None = None
    build_cpu: str | None = None
    # How busy the machine was while the tactics were timed (kiln.plugins.tactics.MachineLoad).
    tactic_timing_load: dict | None = None
    # LoRA (TensorRT-LLM's lora_config): {"max_lora_rank": R, "lora_target_modules": [...]} builds the
    # per-token adapter updates into the step (kiln/models/lora.py); None: no adapters.
    lora_config: dict | None = None
    # "eagle3" (written by engine-build when the checkpoint holds an EAGLE-3 draft, convert_checkpoint
    # --eagle_model_dir): the engine also returns, for every token, the outputs of the target layers
    # `hidden_state_layers` the draft reads (kiln/models/eagle3.py), side by side.
    speculative_decoding_mode: str | None = None
    hidden_state_layers: list | None = None
    # The kiln_cpp ops an aoti engine calls through C functions, as declared when it was built
    # (kiln/plugins/c_shims.py): checked against the plugins' at load.
    c_shims: list | None = None
    kiln_version: str = __version__
    # The device the engine runs on ("cpu"; "cuda" is refused until the CUDA engine exists, issue 64)
    # and its kernels: "cpu" (the families the plugin settings pick) or "triton" (every group on the
    # OpenAI Triton kernels, kiln/plugins/gpu: on CPU tensors, only in Triton's interpreter).
    target_device: str = "cpu"
    kernels: str = "cpu"
    gpu_arch: str | None = None  # a CUDA engine's GPU architecture ("sm_90"), checked at load

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not supported; expected one of {', '.join(BACKENDS)}")
        if self.kernels not in KERNELS:
            raise ConfigError(f"kernels {self.kernels!r} is not supported; expected one of {', '.join(KERNELS)}")
        for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "tokens_per_block",
                     "max_beam_width"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len is not None and self.max_input_len > self.max_seq_len:
            raise ConfigError(
                f"max_input_len ({self.max_input_len}) must not exceed max_seq_len ({self.max_seq_len})"
            )
        if self.max_beam_width > self.max_batch_size:
            raise ConfigError(f"max_beam_width ({self.max_beam_width}) must not exceed max_batch_size "
                              f"({self.max_batch_size}): every beam takes a batch slot")
        if self.max_num_tokens < self.max_batch_size:
            raise ConfigError(
                f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size ({self.max_batch_size})"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.tokens_per_block)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BuildConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class EngineConfig:
    pretrained_config: PretrainedConfig
    build_config: BuildConfig

    def to_dict(self) -> dict:
        return {"version": __version__, "pretrained_config": self.pretrained_config.to_dict(),
                "build_config": self.build_config.to_dict()}

    @classmethod
    def load(cls, engine_dir: str | Path) -> "EngineConfig":
        path = Path(engine_dir) / "config.json"
        d = read_json(path)
        if not isinstance(d, dict) or "pretrained_config" not in d or "build_config" not in d:
            raise ConfigError(f"{path} is not an engine config (expected 'pretrained_config' and 'build_config')")
        built_with = d["build_config"].get("kiln_version") or d.get("version")
        if not compatible_version(built_with):
            raise ConfigError(
                f"engine dir {engine_dir} was built by kiln {built_with}, which this kiln "
                f"({__version__}) cannot load; rebuild it with `engine-build`"
            )
        try:
            return cls(PretrainedConfig.from_dict(d["pretrained_config"]),
                       BuildConfig.from_dict(d["build_config"]))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


def compatible_version(built_with: str | None) -> bool:
    """Engines are compatible within one major.minor release."""
    if not built_with:
        return False
    return built_with.split(".")[:2] == __version__.split(".")[:2]


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path} not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
