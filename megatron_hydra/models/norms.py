"""The norms of a Transformer block, including zero-centred ones (Gemma; Transformer Engine's
``zero_centered_gamma``): the stored weight w scales by (1 + w), so a weight decayed towards zero
pulls the scale towards one, not towards zero. Such weights start at zero (``models.init``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.config.transformer_config import TransformerConfig


class ZeroCenteredRMSNorm(nn.RMSNorm):
    """(1 + w) formed in float32 at least, as the reference (Gemma) computes it: in bf16, 1 + w
    would round w's small deviations from zero away."""

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        return F.rms_norm(x.to(wide), self.normalized_shape, 1 + self.weight.to(wide), self.eps).to(x.dtype)


class ZeroCenteredLayerNorm(nn.LayerNorm):
    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        bias = None if self.bias is None else self.bias.to(wide)
        return F.layer_norm(x.to(wide), self.normalized_shape, 1 + self.weight.to(wide), bias, self.eps).to(x.dtype)


def norm_module(cfg: TransformerConfig, size: int, device=None) -> nn.Module:
    """The norm ``cfg`` asks for (``normalization``, ``zero_centered_gamma``) over the last ``size``
    features."""
    rms = cfg.normalization == "rmsnorm"
    if cfg.zero_centered_gamma:
        cls = ZeroCenteredRMSNorm if rms else ZeroCenteredLayerNorm
    else:
        cls = nn.RMSNorm if rms else nn.LayerNorm
    return cls(size, eps=cfg.norm_eps, dtype=cfg.params_dtype, device=device)
