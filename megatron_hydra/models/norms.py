"""The norms of a Transformer block, including zero-centred ones (Gemma; Transformer Engine's
``zero_centered_gamma``): the stored weight w scales by (1 + w), so a weight decayed towards zero
pulls the scale towards one, not towards zero. Such weights start at zero (``models.init``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.config.transformer_config import TransformerConfig


class ZeroCenteredRMSNorm(nn.RMSNorm):
    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, 1 + self.weight, self.eps)


class ZeroCenteredLayerNorm(nn.LayerNorm):
    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, 1 + self.weight, self.bias, self.eps)


def norm_module(cfg: TransformerConfig, size: int, device=None) -> nn.Module:
    """The norm ``cfg`` asks for (``normalization``, ``zero_centered_gamma``) over the last ``size``
    features."""
    rms = cfg.normalization == "rmsnorm"
    if cfg.zero_centered_gamma:
        cls = ZeroCenteredRMSNorm if rms else ZeroCenteredLayerNorm
    else:
        cls = nn.RMSNorm if rms else nn.LayerNorm
    return cls(size, eps=cfg.norm_eps, dtype=cfg.params_dtype, device=device)
