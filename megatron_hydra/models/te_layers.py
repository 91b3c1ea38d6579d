"""Transformer Engine layers of a Transformer block (``model.transformer_impl=transformer_engine``).

A block runs on ``transformer_engine.pytorch``: ``LayerNormLinear`` fuses the input norm with the
QKV projection and the pre-MLP norm with fc1, ``Linear`` is the attention output projection and
fc2, ``DotProductAttention`` the core attention (causal, GQA through ``num_gqa_groups``), and TE's
``LayerNorm`` / ``RMSNorm`` the norm that stands alone (the final norm). Each takes our TP group
(``tp_group``, ``tp_size``): QKV and fc1 are column-parallel, proj and fc2 row-parallel, with
``sequence_parallel`` as configured, so TE does the communication that ``parallel.layers`` does
for the local layers. The activation (gelu, swiglu, ...) and rotary embedding are ours, the same
code as the local block's.

Names. ``PARAMETERS`` (via ``parameter_map``) is the one place where the two implementations'
names meet: each TE parameter is the local parameters it holds, stacked along dim 0. Everything
that names tensors (initialisation, checkpoints, Hugging Face conversion) goes through
``models.backends.logical_parameters``, so a checkpoint does not know which implementation wrote
it. A gated MLP's fc1 holds SwiGLU's gate and up projections in one weight, gate first (the order
TE's and Megatron's SwiGLU read them): on a TP rank it is [this rank's gate shard; its up shard],
two row ranges of the local tensor, each one logical tensor's shard.

Layout. TE's sequence parallelism gathers and scatters along the first dimension and
``DotProductAttention`` reads ``sbhd``, so a stack runs sequence-first inside (``SequenceFirst``:
[b, s, h] -> [s, b, h] on entry, back on exit; under SP each rank's slice is [s/tp, b, h]).

FP8. With ``precision.fp8`` the forward of a stack (one pipeline chunk's layers, every
micro-batch) runs under ``fp8_autocast(enabled=True, fp8_recipe=..., fp8_group=<dp x cp x tp>)``:
all of a chunk's TE layers share one autocast region, whose exit reduces the amaxes over the
ranks that hold the same layers. Generation with a KV cache runs without it (its one-token steps
are not FP8 GEMM shapes).

Transformer Engine is imported on first use, so this module (and its name mapping) imports where
TE is absent; building a layer there is a one-line ``ConfigError``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.config.transformer_config import FP8Recipe, TransformerConfig
from megatron_hydra.errors import ConfigError
from megatron_hydra.models.rope import RotaryEmbedding
from megatron_hydra.models.transformer import GATED
from megatron_hydra.parallel.layers import replicated
from megatron_hydra.parallel.random import TP_RNG, get_rng_tracker
from megatron_hydra.parallel.state import ParallelState

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def te():
    """``transformer_engine.pytorch``; a one-line ``ConfigError`` where it is not installed."""
    try:
        import transformer_engine.pytorch as te_pytorch
    except ImportError as e:
        raise ConfigError("model.transformer_impl=transformer_engine needs NVIDIA Transformer Engine, which this "
                          "environment lacks (it comes with NVIDIA's NGC PyTorch image, see the Dockerfile): use "
                          "model.transformer_impl=local (checkpoints load under either)") from e
    return te_pytorch


# Names -----------------------------------------------------------------------------------------
def parameter_map(cfg: TransformerConfig) -> Dict[str, Tuple[str, ...]]:
    """Each TE parameter of a block (block-relative name) -> the local block's parameters it
    holds, stacked along dim 0 in this order. Entries whose parameter the variant lacks (biases,
    RMSNorm's bias) simply match nothing."""
    fc1 = ("mlp.gate", "mlp.fc1") if cfg.activation in GATED else ("mlp.fc1",)
    return {
        "attention.qkv.layer_norm_weight": ("norm1.weight",),
        "attention.qkv.layer_norm_bias": ("norm1.bias",),
        "attention.qkv.weight": ("attention.qkv.weight",),
        "attention.qkv.bias": ("attention.qkv.bias",),
        "attention.proj.weight": ("attention.proj.weight",),
        "attention.proj.bias": ("attention.proj.bias",),
        "mlp.fc1.layer_norm_weight": ("norm2.weight",),
        "mlp.fc1.layer_norm_bias": ("norm2.bias",),
        "mlp.fc1.weight": tuple(f"{name}.weight" for name in fc1),
        "mlp.fc1.bias": tuple(f"{name}.bias" for name in fc1),
        "mlp.fc2.weight": ("mlp.fc2.weight",),
        "mlp.fc2.bias": ("mlp.fc2.bias",),
    }


def _tag(module: nn.Module, parallel_mode: str, sequence_parallel: bool) -> nn.Module:
    """Tag a TE linear layer's parameters as ``parallel.layers`` tags its own: weights (and a
    column layer's bias) split along their TP dim; norm parameters and a row layer's bias held
    whole, their grads summed over TP under sequence parallelism."""
    for name, p in module.named_parameters():
        if name.startswith("layer_norm_"):
            dim = None
        elif parallel_mode == "column":
            dim = 0
        else:
            dim = 1 if name == "weight" else None
        p.tp_partition_dim, p.sequence_parallel = dim, sequence_parallel and dim is None
    return module


def _device(device):
    """TE's modules live on the GPU (its own default); tests pass CPU or meta explicitly."""
    return "cuda" if device is None else device


def _keep(weight: torch.Tensor) -> None:
    """``init_method`` that leaves the weight as is: ``models.init.init_weights`` fills every
    parameter from its logical name afterwards, without drawing from the run's generators."""


def _linear(cfg: TransformerConfig, ps: ParallelState, in_features: int, out_features: int, parallel_mode: str,
            device, norm: bool) -> nn.Module:
    t = te()
    common = dict(sequence_parallel=cfg.sequence_parallel, tp_group=ps.tp_group, tp_size=ps.tp_size,
                  init_method=_keep, bias=cfg.add_bias_linear, params_dtype=cfg.params_dtype,
                  parallel_mode=parallel_mode, device=_device(device))
    if norm:
        layer = t.LayerNormLinear(in_features, out_features, eps=cfg.norm_eps,
                                  normalization="RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm", **common)
    else:
        layer = t.Linear(in_features, out_features, **common)
    return _tag(layer, parallel_mode, cfg.sequence_parallel)


def build_norm(cfg: TransformerConfig, device=None) -> nn.Module:
    """A norm that stands alone (the final norm): TE's LayerNorm or RMSNorm."""
    t = te()
    cls = t.RMSNorm if cfg.normalization == "rmsnorm" else t.LayerNorm
    norm = cls(cfg.hidden_size, eps=cfg.norm_eps, params_dtype=cfg.params_dtype, device=_device(device))
    return replicated(norm, cfg.sequence_parallel)


def fused_norm(cfg: TransformerConfig, device=None) -> nn.Module:
    """The norm in front of attention and MLP: none of its own, LayerNormLinear applies it."""
    return nn.Identity()


# Layers ----------------------------------------------------------------------------------------
class _TPStream:
    """What ``DotProductAttention`` asks of an RNG tracker (``fork()``, ``get_states()``), served
    by our TP-sharded stream (``parallel.random``): attention dropout draws per TP rank, as the
    local attention's does."""

    def fork(self, name: str = TP_RNG):
        return get_rng_tracker().fork(name)

    def get_states(self) -> Dict[str, torch.Tensor]:
        states = get_rng_tracker().states
        return {name: by_device.get("cuda", by_device.get("cpu")) for name, by_device in states.items()}


_TP_STREAM = _TPStream()


class TEAttention(nn.Module):
    """Self-attention on TE; parameters and QKV layout as the local ``Attention`` (per query group
    [q heads of the group, k, v]). Input and output are sequence-first, [s, b, h]. ``layer``: the
    global index, for its RoPE tables (``models.rope.layer_rope``)."""

    def __init__(self, cfg: TransformerConfig, ps: ParallelState, device=None, causal: bool = True, layer: int = 0):
        super().__init__()
        t = te()
        d, heads, groups = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
        self.cfg, self.heads_per_group, self.local_groups = cfg, heads // groups, groups // ps.tp_size
        self.qkv = _linear(cfg, ps, cfg.hidden_size, (heads + 2 * groups) * d, "column", device, norm=True)
        extra = {} if cfg.softmax_scale is None else {"softmax_scale": cfg.softmax_scale}
        # sequence_parallel=False: DotProductAttention reads it only to skip forking the RNG
        # tracker for dropout, and this rank's heads are its own with or without SP.
        self.core = t.DotProductAttention(heads, d, num_gqa_groups=groups, attention_dropout=cfg.attention_dropout,
                                          qkv_format="sbhd", attn_mask_type="causal" if causal else "no_mask",
                                          sequence_parallel=False, tp_size=ps.tp_size, tp_group=ps.tp_group,
                                          get_rng_state_tracker=(lambda: _TP_STREAM) if cfg.attention_dropout else None,
                                          **extra)
        self.proj = _linear(cfg, ps, heads * d, cfg.hidden_size, "row", device, norm=False)
        self.rotary = RotaryEmbedding(cfg, device, layer) if cfg.position_embedding == "rope" else None

    def forward(self, x: torch.Tensor, kv_cache=None, mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if mask is not None or position_ids is not None or document_ids is not None:
            raise ValueError("the Transformer Engine attention takes no mask (GPT's is causal), no position ids and no "
                             "document ids (context parallelism and document masks run on model.transformer_impl=local)")
        qkv = self.qkv(x)  # [s, b, local_groups * (heads_per_group + 2) * d], the input norm applied
        s, b, _ = qkv.shape
        hpg, d = self.heads_per_group, self.cfg.kv_channels
        qkv = qkv.view(s, b, self.local_groups, hpg + 2, d)
        q = qkv[:, :, :, :hpg].reshape(s, b, -1, d)  # [s, b, heads, d]
        k, v = qkv[:, :, :, hpg], qkv[:, :, :, hpg + 1]  # [s, b, groups, d]
        if self.rotary is not None:
            offset = 0 if kv_cache is None else kv_cache.length(self)
            q, k = (self.rotary(t.permute(1, 2, 0, 3), offset).permute(2, 0, 1, 3) for t in (q, k))
        if kv_cache is not None:  # generation: the cache works in [b, heads, s, d]
            out = kv_cache.attend(self, *(t.permute(1, 2, 0, 3) for t in (q, k, v)))
            return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))
        selective = self.training and self.cfg.recompute_granularity == "selective"
        return self.proj(self.core(q, k, v, checkpoint_core_attention=selective))

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[b, heads, s, d] in and out, as the local attention's (the KV cache calls it for a
        prompt)."""
        out = self.core(*(t.permute(2, 0, 1, 3) for t in (q, k, v)))  # [s, b, heads * d]
        return out.view(out.shape[0], out.shape[1], -1, q.shape[-1]).permute(1, 2, 0, 3)


class TEMLP(nn.Module):
    """Norm + fc1 (column-parallel LayerNormLinear; a gated activation's gate and up projections
    in one weight), the activation, fc2 (row-parallel Linear). Sequence-first in and out."""

    def __init__(self, cfg: TransformerConfig, ps: ParallelState, device=None):
        super().__init__()
        self.activation = cfg.activation
        width = cfg.ffn_hidden_size * (2 if cfg.activation in GATED else 1)
        self.fc1 = _linear(cfg, ps, cfg.hidden_size, width, "column", device, norm=True)
        self.fc2 = _linear(cfg, ps, cfg.ffn_hidden_size, cfg.hidden_size, "row", device, norm=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.activation in GATED:
            gate, up = h.chunk(2, dim=-1)  # this rank's [gate shard, up shard]
            h = GATED[self.activation](gate) * up
        else:
            h = ACTIVATIONS[self.activation](h)
        return self.fc2(h)


# How a stack runs --------------------------------------------------------------------------------
def fp8_recipe(spec: FP8Recipe):
    """TE's recipe for ``precision.fp8``: DelayedScaling or Float8CurrentScaling, in the HYBRID
    (E4M3 forward, E5M2 backward) or E4M3 format."""
    from transformer_engine.common import recipe

    fmt = {"hybrid": recipe.Format.HYBRID, "e4m3": recipe.Format.E4M3}[spec.format]
    if spec.recipe == "current":
        if not hasattr(recipe, "Float8CurrentScaling"):
            raise ConfigError("precision.fp8.recipe=current: this Transformer Engine has no Float8CurrentScaling "
                              "recipe (newer releases do): use precision.fp8.recipe=delayed")
        return recipe.Float8CurrentScaling(fp8_format=fmt)
    return recipe.DelayedScaling(fp8_format=fmt, margin=spec.margin, amax_history_len=spec.amax_history_len,
                                 amax_compute_algo=spec.amax_compute_algo)


class SequenceFirst:
    """Runs a stack's layers sequence-first, under FP8 autocast when ``precision.fp8`` is set
    (see the module docstring). ``fp8_group``: the amax reduction group, data x context x tensor
    parallel (Megatron's), the ranks that hold the same layers."""

    def __init__(self, cfg: TransformerConfig, ps: ParallelState):
        self.recipe = None if cfg.fp8 is None else fp8_recipe(cfg.fp8)
        self.fp8_group = ps.group("amax")

    def __call__(self, run, x: torch.Tensor, generating: bool = False) -> torch.Tensor:
        fp8 = self.recipe is not None and not generating
        context = te().fp8_autocast(enabled=True, fp8_recipe=self.recipe, fp8_group=self.fp8_group) if fp8 else nullcontext()
        with context:
            y = run(x.transpose(0, 1).contiguous())
        return y.transpose(0, 1).contiguous()
