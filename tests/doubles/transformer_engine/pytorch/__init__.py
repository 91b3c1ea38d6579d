"""TEST DOUBLE of transformer_engine.pytorch (see tests/doubles/README.md).

The classes megatron-hydra uses, with Transformer Engine's constructor parameters (names and
defaults as TE documents them; the ones we never pass raise if set) and plain-torch forward
semantics, tensor parallelism included: a column-parallel layer holds out_features / tp rows, a
row-parallel one in_features / tp columns (tp from ``tp_group``, else ``tp_size``); under
sequence parallelism the column layer all-gathers its normalised input along the first dimension
and the row layer reduce-scatters its output along it, otherwise the row layer all-reduces (bias
added after the reduction). ``fp8_autocast`` records its arguments (``AUTOCASTS``) and computes
nothing in FP8.
"""

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

AUTOCASTS = []  # (enabled, fp8_recipe, fp8_group) of each fp8_autocast entered

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _world(tp_group, tp_size):
    return dist.get_world_size(tp_group) if tp_group is not None else tp_size


def _gather_first(x, group):
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    _all_gather(out, x.contiguous(), group=group)
    return out


def _scatter_first(x, group):
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    _reduce_scatter(out, x.contiguous(), group=group)
    return out


def _all_reduce(x, group):
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


class _Comm(torch.autograd.Function):
    """Forward ``kind``, backward its adjoint: copy <-> all-reduce, gather <-> reduce-scatter."""

    ADJOINT = {"copy": "all_reduce", "all_reduce": "copy", "gather": "scatter", "scatter": "gather"}
    RUN = {"all_reduce": _all_reduce, "gather": _gather_first, "scatter": _scatter_first}

    @staticmethod
    def forward(ctx, x, kind, group):
        ctx.kind, ctx.group = kind, group
        return x.view_as(x) if kind == "copy" else _Comm.RUN[kind](x, group)

    @staticmethod
    def backward(ctx, grad):
        kind = _Comm.ADJOINT[ctx.kind]
        return (grad if kind == "copy" else _Comm.RUN[kind](grad, ctx.group)), None, None


def _unsupported(**given):
    for name, value in given.items():
        if value:
            raise NotImplementedError(f"the Transformer Engine test double does not implement {name}")


def _default_init(weight):
    nn.init.normal_(weight, mean=0.0, std=0.023)


class _LinearBase(nn.Module):
    def __init__(self, in_features, out_features, *, sequence_parallel, tp_group, tp_size, init_method, bias,
                 params_dtype, parallel_mode, device):
        super().__init__()
        assert parallel_mode in (None, "column", "row"), f"parallel_mode {parallel_mode} not supported"
        self.tp_group, self.tp_size = tp_group, _world(tp_group, tp_size)
        self.parallel_mode, self.sequence_parallel = parallel_mode, self.tp_size > 1 and sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        if parallel_mode == "column":
            self.out_features = out_features // self.tp_size
        elif parallel_mode == "row":
            self.in_features = in_features // self.tp_size
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, device=device, dtype=dtype))
        self.use_bias = bias
        self.bias = (nn.Parameter(torch.zeros(self.out_features, device=device, dtype=dtype)) if bias
                     else torch.empty(0, device=device, dtype=dtype))
        if device != "meta":
            (init_method or _default_init)(self.weight)

    def _comm(self, kind, x):
        if self.tp_size == 1:
            return x
        if self.tp_group is None:
            raise RuntimeError("tensor-parallel group not set (set_tensor_parallel_group)")
        return _Comm.apply(x, kind, self.tp_group)

    def _linear(self, inp, x):
        """x: the (normalised) input as [tokens, in_features], inp: the original input."""
        if self.parallel_mode == "column":
            x = self._comm("gather" if self.sequence_parallel else "copy", x)
        out = F.linear(x, self.weight, self.bias if self.use_bias and self.parallel_mode != "row" else None)
        if self.parallel_mode == "row":
            out = self._comm("scatter" if self.sequence_parallel else "all_reduce", out)
            if self.use_bias:
                out = out + self.bias
        return out.view(-1, *inp.shape[1:-1], out.shape[-1])


class Linear(_LinearBase):
    def __init__(self, in_features, out_features, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True, return_bias=False,
                 params_dtype=None, parallel_mode=None, parameters_split=None, device="cuda"):
        _unsupported(fuse_wgrad_accumulation=fuse_wgrad_accumulation, return_bias=return_bias,
                     parameters_split=parameters_split)
        super().__init__(in_features, out_features, sequence_parallel=sequence_parallel, tp_group=tp_group,
                         tp_size=tp_size, init_method=init_method, bias=bias, params_dtype=params_dtype,
                         parallel_mode=parallel_mode, device=device)

    def forward(self, inp, is_first_microbatch=None):
        return self._linear(inp, inp.view(-1, inp.shape[-1]))


def _normalize(x, normalization, weight, bias, eps):
    if normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class LayerNormLinear(_LinearBase):
    def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 normalization="LayerNorm", return_bias=False, params_dtype=None, parallel_mode=None,
                 return_layernorm_output=False, parameters_split=None, zero_centered_gamma=False, device="cuda"):
        _unsupported(fuse_wgrad_accumulation=fuse_wgrad_accumulation, return_bias=return_bias,
                     return_layernorm_output=return_layernorm_output, parameters_split=parameters_split,
                     zero_centered_gamma=zero_centered_gamma)
        assert normalization in ("LayerNorm", "RMSNorm"), "Unsupported normalization type!"
        super().__init__(in_features, out_features, sequence_parallel=sequence_parallel, tp_group=tp_group,
                         tp_size=tp_size, init_method=init_method, bias=bias, params_dtype=params_dtype,
                         parallel_mode=parallel_mode, device=device)
        dtype = params_dtype or torch.get_default_dtype()
        self.eps, self.normalization = eps, normalization
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, device=device, dtype=dtype))
        self.layer_norm_bias = (nn.Parameter(torch.zeros(in_features, device=device, dtype=dtype))
                                if normalization != "RMSNorm" else None)

    def forward(self, inp, is_first_microbatch=None):
        x = inp.view(-1, inp.shape[-1])
        x = _normalize(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        return self._linear(inp, x)


class LayerNorm(nn.Module):
    KIND = "LayerNorm"

    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=None, params_dtype=None, zero_centered_gamma=False,
                 device="cuda"):
        super().__init__()
        _unsupported(zero_centered_gamma=zero_centered_gamma)
        dtype = params_dtype or torch.get_default_dtype()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        if self.KIND == "LayerNorm":
            self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        else:
            self.bias = None

    def forward(self, inp):
        return _normalize(inp, self.KIND, self.weight, self.bias, self.eps)


class RMSNorm(LayerNorm):
    """TE's RMSNorm: the same arguments, a weight and no bias."""

    KIND = "RMSNorm"


class DotProductAttention(nn.Module):
    """Core attention over this rank's heads; q [.., heads / tp, d], k and v [.., gqa groups / tp, d]
    in ``qkv_format``; output [.., heads / tp * d]. Masks: causal (top-left) or no_mask."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, sequence_parallel=False, tp_size=1,
                 get_rng_state_tracker=None, tp_group=None, layer_number=None, attention_type="self",
                 softmax_scale=None):
        super().__init__()
        _unsupported(window_size=window_size)
        assert attn_mask_type in ("causal", "no_mask"), f"the double implements causal and no_mask, not {attn_mask_type}"
        assert attention_type == "self"
        tp = _world(tp_group, tp_size)
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        assert num_attention_heads % groups == 0, "The number of attention heads must be divisible by the number of GQA groups!"
        self.heads, self.groups = num_attention_heads // tp, groups // tp
        self.qkv_format, self.attn_mask_type, self.attention_dropout = qkv_format, attn_mask_type, attention_dropout
        self.softmax_scale = softmax_scale if softmax_scale is not None else kv_channels ** -0.5
        self.tracker = None if sequence_parallel or get_rng_state_tracker is None else get_rng_state_tracker()

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None, attn_mask_type=None,
                checkpoint_core_attention=False):
        assert attention_mask is None
        fmt, mask_type = qkv_format or self.qkv_format, attn_mask_type or self.attn_mask_type
        assert fmt in ("sbhd", "bshd")
        assert query_layer.shape[2] == self.heads and key_layer.shape[2] == value_layer.shape[2] == self.groups
        to_bhsd = (lambda t: t.permute(1, 2, 0, 3)) if fmt == "sbhd" else (lambda t: t.permute(0, 2, 1, 3))
        p = self.attention_dropout if self.training else 0.0

        def attend(q, k, v):
            with self.tracker.fork() if (self.tracker is not None and p) else nullcontext():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=mask_type == "causal",
                                                      scale=self.softmax_scale, enable_gqa=self.heads != self.groups)

        q, k, v = (to_bhsd(t) for t in (query_layer, key_layer, value_layer))
        out = checkpoint(attend, q, k, v, use_reentrant=False) if checkpoint_core_attention else attend(q, k, v)
        out = out.permute(2, 0, 1, 3) if fmt == "sbhd" else out.permute(0, 2, 1, 3)
        return out.reshape(*out.shape[:2], -1)


@contextmanager
def fp8_autocast(enabled=False, calibrating=False, fp8_recipe=None, fp8_group=None):
    AUTOCASTS.append((enabled, fp8_recipe, fp8_group))
    yield
