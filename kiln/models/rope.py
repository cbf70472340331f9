"""Rotary position embedding frequencies, with HF's scaling types (linear, dynamic NTK, llama3, YaRN,
LongRoPE), over the first rotary_dim dims of each head."""
import dataclasses
import math

import torch
from torch import nn

from kiln.config import PretrainedConfig


def inv_freq(config: PretrainedConfig, long: bool = False) -> torch.Tensor:
    """long: LongRoPE's frequencies for sequences past original_max_position_embeddings."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    freq = 1.0 / (config.rotary_base ** exponents)
    scaling = config.rotary_scaling or {}
    kind = scaling.get("type")
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        freq = 1.0 / (factors * config.rotary_base ** exponents)
    elif kind == "linear":
        freq = freq / scaling["factor"]
    elif kind == "llama3":
        freq = _llama3(freq, scaling)
    elif kind == "yarn":
        freq = _yarn(config, scaling)
    return freq


def attention_factor(config: PretrainedConfig) -> float:
    """What cos and sin are multiplied by (so q.k by its square): YaRN's mscale, LongRoPE's factor, else 1."""
    scaling = config.rotary_scaling or {}
    if scaling.get("type") == "longrope":
        return scaling["attention_factor"]
    if scaling.get("type") != "yarn":
        return 1.0
    return yarn_parameters(config, scaling)["attention_factor"]


def _llama3(freq, scaling):
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_parameters(config: PretrainedConfig, scaling: dict) -> dict:
    """HF's YaRN defaults for what a rotary_scaling dict leaves out (convert_checkpoint writes them
    all; a ModelOpt export carries HF's rope_scaling as it was)."""
    original = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = scaling.get("factor") or config.max_position_embeddings / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    truncate = scaling.get("truncate")
    return dict(factor=factor, original=original, attention_factor=float(attn),
                beta_fast=scaling.get("beta_fast") or 32, beta_slow=scaling.get("beta_slow") or 1,
                truncate=True if truncate is None else truncate)


def _yarn(config: PretrainedConfig, scaling: dict) -> torch.Tensor:
    # As transformers' _compute_yarn_parameters, expression for expression (float32 rounding included).
    p = yarn_parameters(config, scaling)
    dim, base = config.rotary_dim, config.rotary_base

    def correction_dim(rotations):
        return (dim * math.log(p["original"] / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (p["factor"] * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def cos_sin(config: PretrainedConfig, freq: torch.Tensor, positions: torch.Tensor,
            rope_lens: torch.Tensor | None = None, long_freq: torch.Tensor | None = None,
            sequence_lens: torch.Tensor | None = None):
    """cos/sin [T, rotary_dim / 2] for each token, times the scaling type's attention factor.

    Dynamic NTK scaling (as HF applies it) stretches the base once a sequence runs past
    max_position_embeddings, by how far the forward pass that computes the token reaches:
    `rope_lens` gives that length per token. LongRoPE rotates the tokens of sequences longer than
    original_max_position_embeddings (`sequence_lens`, per token) by `long_freq` instead.
    """
    pos = positions.float()[:, None]
    scaling = config.rotary_scaling or {}
    if scaling.get("type") == "longrope":
        long = (sequence_lens > config.long_rope_threshold)[:, None]
        angles = pos * torch.where(long, long_freq[None, :], freq[None, :])
    elif scaling.get("type") != "dynamic":
        angles = pos * freq[None, :]
    else:
        dim, max_pos, factor = config.rotary_dim, config.max_position_embeddings, scaling["factor"]
        seq_len = torch.clamp(rope_lens.float(), min=max_pos)[:, None]
        base = config.rotary_base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
        angles = pos * (1.0 / base ** exponents[None, :])
    scale = attention_factor(config)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


class RotaryTables(nn.Module):
    """A step's cos/sin tables, per rope a layer may use: "global", and Gemma 3's "local" (its
    sliding layers' own base, unscaled)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config = config
        self.dynamic = (config.rotary_scaling or {}).get("type") == "dynamic"
        self.register_buffer("inv_freq", inv_freq(config), persistent=False)
        self.register_buffer("inv_freq_long", inv_freq(config, long=True) if config.long_rope_threshold else None,
                             persistent=False)
        self.local = None if config.rotary_base_local is None else dataclasses.replace(
            config, rotary_base=config.rotary_base_local, rotary_scaling=None)
        self.register_buffer("inv_freq_local", None if self.local is None else inv_freq(self.local),
                             persistent=False)

    def forward(self, positions, meta, sequence_lens=None) -> dict:
        """meta: the step's kiln.models.ops.base.StepMeta; sequence_lens: LongRoPE's per-token lengths."""
        lens = _rope_lens(positions, meta.ctx_token_index, meta.ctx_context_lens) if self.dynamic else None
        tables = {"global": cos_sin(self.config, self.inv_freq, positions, lens, self.inv_freq_long, sequence_lens)}
        if self.local is not None:
            tables["local"] = cos_sin(self.local, self.inv_freq_local, positions)
        return tables


def _rope_lens(positions, ctx_token_index, ctx_context_lens):
    """Per token, the length its forward pass reaches: the chunk's end for context tokens, else pos + 1."""
    T = positions.shape[0]
    lens = torch.cat([positions + 1, positions.new_zeros(1)])
    index = torch.where(ctx_token_index >= 0, ctx_token_index, T).flatten()
    lens = lens.index_put((index,), ctx_context_lens[:, None].expand_as(ctx_token_index).flatten().to(lens.dtype))
    return lens[:T]
