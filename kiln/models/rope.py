"""Rotary position embedding frequencies, with HF's scaling types (linear, dynamic NTK, llama3)."""
import math

import torch

from kiln.config import PretrainedConfig


def inv_freq(config: PretrainedConfig) -> torch.Tensor:
    dim = config.head_size
    freq = 1.0 / (config.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rotary_scaling or {}
    kind = scaling.get("type")
    if kind == "linear":
        freq = freq / scaling["factor"]
    elif kind == "llama3":
        freq = _llama3(freq, scaling)
    return freq


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


def cos_sin(config: PretrainedConfig, freq: torch.Tensor, positions: torch.Tensor,
            rope_lens: torch.Tensor | None = None):
    """cos/sin [T, head_size / 2] for each token.

    Dynamic NTK scaling (as HF applies it) stretches the base once a sequence runs past
    max_position_embeddings, by how far the forward pass that computes the token reaches:
    `rope_lens` gives that length per token.
    """
    pos = positions.float()[:, None]
    scaling = config.rotary_scaling or {}
    if scaling.get("type") != "dynamic":
        angles = pos * freq[None, :]
    else:
        dim, max_pos, factor = config.head_size, config.max_position_embeddings, scaling["factor"]
        seq_len = torch.clamp(rope_lens.float(), min=max_pos)[:, None]
        base = config.rotary_base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
        angles = pos * (1.0 / base ** exponents[None, :])
    return angles.cos(), angles.sin()
