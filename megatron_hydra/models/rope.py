"""Rotary position embedding (rotate-half convention: GPT-NeoX, Llama in Hugging Face layout), with
the frequency scalings of today's long-context models.

A scaling changes only the inverse frequencies (and, for YaRN, multiplies cos and sin by an
attention factor), so each layer keeps one cos/sin table and the attention code is the same for
every model. The formulas follow the published methods as transformers implements them
(``modeling_rope_utils``), operation for operation, so that an imported checkpoint sees the
frequencies it was trained with:

- ``linear`` (position interpolation, Chen et al. 2023): every frequency divided by ``factor``;
- ``llama3`` (Llama 3.1): wavelengths longer than ``original / low_freq_factor`` are divided by
  ``factor``, shorter than ``original / high_freq_factor`` kept, and those between blended;
- ``yarn`` (Peng et al. 2023): per dimension, a ramp between interpolated and original frequencies
  over the dimensions that turn between ``beta_fast`` and ``beta_slow`` times in the original
  context; cos and sin scaled by ``attention_factor`` (default 0.1 ln(factor) + 1).

Tables are computed in float64 and cast once, so a float64 model is exact to the last bit of the
formulas.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from megatron_hydra.config.transformer_config import RopeScaling, TransformerConfig


def _base_frequencies(dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    long_wavelength = s.original_max_position_embeddings / s.low_freq_factor
    short_wavelength = s.original_max_position_embeddings / s.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > long_wavelength, inv_freq / s.factor, inv_freq)
    # Between the two wavelengths: blend the divided and the kept frequency, linearly in
    # original / wavelength (1 where it equals low_freq_factor ... 0 at high_freq_factor).
    smooth = ((s.original_max_position_embeddings / wavelength - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    between = ~(wavelength < short_wavelength) * ~(wavelength > long_wavelength)
    return torch.where(between, blended, scaled)


def yarn_attention_factor(s: RopeScaling) -> float:
    """YaRN's scale of cos and sin: ``attention_factor`` when set, else 0.1 ln(factor) + 1 (its
    paper's Eq. 21; no scaling for factor <= 1)."""
    if s.attention_factor is not None:
        return float(s.attention_factor)
    return 1.0 if s.factor <= 1 else 0.1 * math.log(s.factor) + 1.0


def _yarn(dim: int, theta: float, s: RopeScaling, device=None) -> torch.Tensor:
    def rotations_to_dim(rotations: float) -> float:
        """The (fractional) dimension index whose wavelength fits ``rotations`` times in the
        original context."""
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = rotations_to_dim(s.beta_fast), rotations_to_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the weight of the original frequency
    powers = theta ** (torch.arange(0, dim, 2, device=device).to(torch.float64) / dim)
    return 1.0 / (s.factor * powers) * (1 - keep) + 1.0 / powers * keep


def inverse_frequencies(dim: int, theta: float, scaling: Optional[RopeScaling] = None,
                        device=None) -> Tuple[torch.Tensor, float]:
    """([dim / 2] float64 inverse frequencies, the factor cos and sin are multiplied by) for rotary
    dimension ``dim``, base ``theta`` and ``scaling`` (None: plain RoPE)."""
    if scaling is None:
        return _base_frequencies(dim, theta, device), 1.0
    if scaling.type == "linear":
        return _base_frequencies(dim, theta, device) / scaling.factor, 1.0
    if scaling.type == "llama3":
        return _llama3(_base_frequencies(dim, theta, device), scaling), 1.0
    if scaling.type == "yarn":
        return _yarn(dim, theta, scaling, device), yarn_attention_factor(scaling)
    raise ValueError(f"rope scaling type {scaling.type!r}: llama3, linear, yarn are supported")


def layer_rope(cfg: TransformerConfig, layer: int) -> Tuple[float, Optional[RopeScaling]]:
    """(base, scaling) of global layer ``layer``: a windowed layer of a model with
    ``local_rope_theta`` (Gemma 3's local layers) uses that base, unscaled; every other layer
    ``rope_theta`` with ``rope_scaling``."""
    if cfg.local_rope_theta is not None and cfg.windowed(layer) is not None:
        return cfg.local_rope_theta, None
    return cfg.rope_theta, cfg.rope_scaling


class RotaryEmbedding(nn.Module):
    """One layer's cos/sin tables for ``cfg.seq_length`` positions (``layer``: its global index,
    which picks its base and scaling, ``layer_rope``)."""

    def __init__(self, cfg: TransformerConfig, device=None, layer: int = 0):
        super().__init__()
        self.dim, self.length, self.dtype = cfg.kv_channels, cfg.seq_length, cfg.params_dtype
        self.theta, self.scaling = layer_rope(cfg, layer)
        self.reset_buffers(device)

    def reset_buffers(self, device=None) -> None:
        """Compute the cos/sin tables on ``device`` (again after a model built on the meta
        device gets its storage: ``models.init.materialize``)."""
        inv_freq, factor = inverse_frequencies(self.dim, self.theta, self.scaling, device)
        angles = torch.arange(self.length, dtype=torch.float64, device=device).unsqueeze(-1) * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", (angles.cos() * factor).to(self.dtype), persistent=False)
        self.register_buffer("sin", (angles.sin() * factor).to(self.dtype), persistent=False)

    def tables(self, length: int, dtype: torch.dtype, offset: int = 0,
               position_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``length`` tokens from position ``offset`` ([length, head_dim], views
        of the buffers), or for the positions ``position_ids`` ([batch, seq]; context parallelism:
        this rank's chunks) as [batch, 1, seq, head_dim], gathered once for both q and k."""
        if position_ids is not None:
            return self.cos[position_ids].unsqueeze(1).to(dtype), self.sin[position_ids].unsqueeze(1).to(dtype)
        return self.cos[offset:offset + length].to(dtype), self.sin[offset:offset + length].to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x: [batch, heads, seq, head_dim]; ``offset`` is the position of x's first token."""
        return self.rotate(x, *self.tables(x.shape[-2], x.dtype, offset))
