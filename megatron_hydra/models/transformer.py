"""The Transformer block: pre-norm attention and MLP, written against the tensor-parallel layers.

Activations are ``[batch, sequence, hidden]``; under sequence parallelism the sequence dim holds
this rank's slice between the attention and MLP regions. With TP=1 every parallel layer is a plain
linear layer, so this reads as an ordinary GPT block.

Dropout draws from the stream that matches its tensor's layout (``parallel.random``): attention
probabilities belong to this rank's heads (the TP-sharded stream); the residual branch is
replicated over TP (the default stream, identical on all TP ranks) unless sequence parallelism
gives each rank its own slice of it (the sharded stream again).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.models.lora import add_adapters
from megatron_hydra.models.norms import norm_module
from megatron_hydra.models.rope import RotaryEmbedding
from megatron_hydra.parallel.context_parallel import context_parallel_attention
from megatron_hydra.parallel.document_masks import masked_attention
from megatron_hydra.parallel.layers import ColumnParallelLinear, RowParallelLinear, replicated, same_input
from megatron_hydra.parallel.random import dropout, tp_rng
from megatron_hydra.parallel.recompute import checkpoint, run_layers
from megatron_hydra.parallel.state import ParallelState


def run_stack(cfg: TransformerConfig, layers, x: torch.Tensor, training: bool) -> torch.Tensor:
    """``layers`` (callables of x) in order, with full recomputation as ``cfg`` configures it."""
    return run_layers(layers, x, cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers, training)


def build_norm(cfg: TransformerConfig, device=None) -> nn.Module:
    """A norm over the hidden size (``models.norms``), replicated over TP; under SP each rank sees
    only its sequence slice, so its gradient is summed over TP."""
    return replicated(norm_module(cfg, cfg.hidden_size, device), cfg.sequence_parallel)


class Attention(nn.Module):
    """Self-attention with grouped-query attention, heads split across TP; causal unless
    ``causal=False`` (BERT, T5's encoder). Under context parallelism x holds this rank's chunks of
    each sequence and the core attention exchanges keys and values over the ``cp`` group
    (``parallel.context_parallel``).

    The fused QKV weight is laid out per query group as [q heads of the group, k, v], so that a
    TP rank's contiguous shard holds whole groups: the same logical tensor for every TP degree.
    Cross-attention (``cross=True``, T5's decoder) reads queries and keys/values from different
    tensors, so it has two projections: ``q`` and ``kv`` (per query group [k, v]).

    ``layer`` (the global index) picks the layer's sliding window (``cfg.windowed``) and RoPE base.
    QK-norm (Qwen3, Gemma 3) normalises each head's q and k before RoPE with one weight shared by
    all heads: every TP rank holds it whole but sees only its own heads, so its gradient is summed
    over TP (tagged as the sequence-parallel norms are).
    """

    def __init__(self, cfg: TransformerConfig, ps: ParallelState, device=None, causal: bool = True, cross: bool = False,
                 layer: int = 0):
        super().__init__()
        tp = ps.tp_size
        self.cfg, self.causal = cfg, causal
        self.heads_per_group = cfg.num_attention_heads // cfg.num_query_groups
        self.local_groups = cfg.num_query_groups // tp
        d = cfg.kv_channels
        qkv_out = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d
        common = dict(sequence_parallel=cfg.sequence_parallel, tp_comm_overlap=cfg.tp_comm_overlap,
                      dtype=cfg.params_dtype, device=device)
        qkv_bias = cfg.qkv_bias  # resolved by TransformerConfig
        if cross:
            self.q = ColumnParallelLinear(cfg.hidden_size, cfg.num_attention_heads * d, ps.tp_group, bias=qkv_bias,
                                          **common)
            self.kv = ColumnParallelLinear(cfg.hidden_size, 2 * cfg.num_query_groups * d, ps.tp_group, bias=qkv_bias,
                                           **common)
        else:
            self.qkv = ColumnParallelLinear(cfg.hidden_size, qkv_out, ps.tp_group, bias=qkv_bias, **common)
        self.proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, ps.tp_group,
                                      bias=cfg.add_bias_linear, **common)
        self.rotary = RotaryEmbedding(cfg, device, layer) if cfg.position_embedding == "rope" else None
        if cfg.qk_norm and not cross:
            self.q_norm = replicated(norm_module(cfg, d, device), sequence_parallel=True)
            self.k_norm = replicated(norm_module(cfg, d, device), sequence_parallel=True)
        self.window = None if cross else cfg.windowed(layer)
        self.softcap = cfg.attn_logit_softcapping
        self.cp_group = ps.cp_group if cfg.context_parallel_size > 1 else None

    def forward(self, x: torch.Tensor, kv_cache=None, mask: Optional[torch.Tensor] = None,
                context: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``kv_cache`` (generation only, ``models.kv_cache.KVCache``): x holds the tokens after
        the cached ones; their keys and values join the cache and attention covers all of them.
        ``mask``: see ``core_attention``. ``context``: the tensor cross-attention attends to.
        ``position_ids`` ([batch, seq]): the positions of x's tokens, when they are not 0, 1, ...
        ``document_ids`` ([batch, seq], whole sequences: under sequence parallelism the QKV
        projection has gathered x's sequence): a causal attention stays within each document
        (``parallel.document_masks``); None keeps the fused causal kernel."""
        if context is not None:
            return self.proj(self._core_attention(*self._cross_qkv(x, context), mask).transpose(1, 2).flatten(2))
        qkv = self.qkv(x)  # [b, s, local_groups * (heads_per_group + 2) * d]
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.local_groups, self.heads_per_group + 2, self.cfg.kv_channels)
        q = qkv[:, :, :, : self.heads_per_group].flatten(2, 3).transpose(1, 2)  # [b, heads, s, d]
        k = qkv[:, :, :, self.heads_per_group].transpose(1, 2)  # [b, groups, s, d]
        v = qkv[:, :, :, self.heads_per_group + 1].transpose(1, 2)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        offset = 0 if kv_cache is None else kv_cache.length(self)
        if self.rotary is not None:
            cos, sin = self.rotary.tables(s, q.dtype, offset, position_ids)
            q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        if kv_cache is None:
            out = self._core_attention(q, k, v, mask, document_ids)
        else:
            out = kv_cache.attend(self, q, k, v)
        return self.proj(out.transpose(1, 2).flatten(2))

    def _core_attention(self, q, k, v, mask, document_ids=None):
        """Selective recompute (Korthikanti et al. 2022) keeps only q, k, v of the core attention:
        its [b, heads, s, s] softmax and dropout tensors are rebuilt in backward. Context-parallel
        attention keeps no such tensor (only its output and log-sum-exp), so it is never replayed:
        that would repeat its exchange of keys and values."""
        if self.cp_group is not None:
            return context_parallel_attention(q, k, v, self.cp_group, self.cfg.cp_comm_type, self.causal,
                                              self.cfg.softmax_scale, document_ids, window=self.window,
                                              softcap=self.softcap)
        if document_ids is not None and (mask is not None or not self.causal):
            raise ValueError("document_ids mask a causal self-attention that has no other mask")
        if self.training and self.cfg.recompute_granularity == "selective":
            return checkpoint(self.core_attention, q, k, v, mask, document_ids)
        return self.core_attention(q, k, v, mask, document_ids)

    def _cross_qkv(self, x: torch.Tensor, context: torch.Tensor):
        b, s, _ = x.shape
        d = self.cfg.kv_channels
        q = self.q(x).view(b, s, -1, d).transpose(1, 2)  # [b, heads, s, d]
        kv = self.kv(context).view(b, context.shape[1], self.local_groups, 2, d)
        return q, kv[:, :, :, 0].transpose(1, 2), kv[:, :, :, 1].transpose(1, 2)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """softmax(q k^T * scale + mask) v over this rank's heads: [b, heads, s, d] -> [b, heads, s, d],
        all of the sequence on this rank (generation's KV cache calls it too).
        ``mask`` (broadcast to [b, heads, s_q, s_k]): boolean (True = attend) or additive float,
        which also carries a position bias (T5); it replaces the causal mask, so a causal
        attention given one must include causality in it. scale: ``cfg.softmax_scale`` or 1/sqrt(d).
        ``document_ids`` ([b, s]): causal within each document instead. Without a mask, the layer's
        window and score cap apply (``parallel.document_masks.masked_attention``, which keeps the
        fused causal kernel when there is neither)."""
        p = self.cfg.attention_dropout if self.training else 0.0
        with tp_rng(sharded=True) if p > 0 else nullcontext():
            if mask is not None:
                if self.window is not None or self.softcap is not None:
                    raise ValueError("an explicit attention mask replaces the sliding window and the score cap")
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=self.cfg.softmax_scale,
                                                      enable_gqa=self.heads_per_group > 1)
            return masked_attention(q, k, v, scale=self.cfg.softmax_scale, causal=self.causal, window=self.window,
                                    softcap=self.softcap, document_ids=document_ids, dropout_p=p)


# Gated activations (act(gate(x)) * fc1(x)): SwiGLU (Llama), GEGLU with tanh gelu (T5 v1.1).
GATED = {"swiglu": F.silu, "geglu": partial(F.gelu, approximate="tanh")}


def activation_fn(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise function of ``model.activation`` (of the gate, for a gated one)."""
    if activation in GATED:
        return GATED[activation]
    if activation == "relu":
        return F.relu
    return partial(F.gelu, approximate="tanh" if activation == "gelu_tanh" else "none")


class MLP(nn.Module):
    """Feed-forward: h -> ffn (column-parallel) -> activation -> h (row-parallel). Gated
    activations keep their gate and up projections as two column-parallel layers, so each rank
    holds matching halves."""

    def __init__(self, cfg: TransformerConfig, ps: ParallelState, device=None):
        super().__init__()
        common = dict(bias=cfg.add_bias_linear, sequence_parallel=cfg.sequence_parallel,
                      tp_comm_overlap=cfg.tp_comm_overlap, dtype=cfg.params_dtype, device=device)
        self.activation = cfg.activation
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, ps.tp_group, **common)
        self.gate = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, ps.tp_group, **common) if cfg.activation in GATED else None
        self.fc2 = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, ps.tp_group, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = activation_fn(self.activation)
        if self.gate is not None:
            gate, up = same_input(x, self.gate, self.fc1)
            return self.fc2(act(gate) * up)
        return self.fc2(act(self.fc1(x)))


class Block(nn.Module):
    """One layer: self-attention, optionally cross-attention (``cross``: an encoder-decoder's
    decoder), then the MLP, each a residual branch with dropout.

    Pre-norm (GPT, Llama, T5): ``x + f(norm(x))``. Post-norm (``post_norm``, the original BERT):
    ``norm(x + f(x))``. The modules are the same either way, so are the parameter names. Pre- and
    post-sub-layer norms (``cfg.post_sublayer_norm``, Gemma 2/3): ``x + norm_out(f(norm(x)))``,
    with ``norm1_out`` after attention and ``norm2_out`` after the MLP. ``layer``: the block's
    global index (its attention's window and RoPE base).
    """

    def __init__(self, cfg: TransformerConfig, ps: ParallelState, device=None, causal: bool = True,
                 post_norm: bool = False, cross: bool = False, backend: Optional["Backend"] = None,
                 moe: bool = False, layer: int = 0):
        super().__init__()
        backend = backend or LOCAL
        check_backend(cfg, backend)
        self.norm1 = backend.input_norm(cfg, device)
        self.attention = backend.attention(cfg, ps, device, causal=causal, layer=layer)
        self.norm1_out = backend.norm(cfg, device) if cfg.post_sublayer_norm else None
        if cross:
            self.norm_cross = build_norm(cfg, device)
            self.cross_attention = Attention(cfg, ps, device, causal=False, cross=True)
        self.norm2 = backend.input_norm(cfg, device)
        if moe and backend.moe is None:
            raise ValueError(f"the {backend.name} layers have no Mixture-of-Experts MLP (config.moe: local only)")
        self.mlp = backend.moe(cfg, ps, device) if moe else backend.mlp(cfg, ps, device)
        self.norm2_out = backend.norm(cfg, device) if cfg.post_sublayer_norm else None
        if cfg.lora is not None:  # peft=lora: adapters beside the target layers (models.lora)
            add_adapters(self, cfg, ps, device)
        mark_logical(self, backend.parameter_map(cfg))
        self.post_norm, self.cross = post_norm, cross
        self.dropout, self.sequence_parallel = cfg.hidden_dropout, cfg.sequence_parallel

    def _residual(self, x: torch.Tensor, norm: nn.Module, branch, norm_out: Optional[nn.Module] = None) -> torch.Tensor:
        drop = partial(dropout, p=self.dropout, training=self.training, sharded=self.sequence_parallel)
        if self.post_norm:
            return norm(x + drop(branch(x)))
        out = branch(norm(x))
        return x + drop(out if norm_out is None else norm_out(out))

    def forward(self, x: torch.Tensor, kv_cache=None, mask: Optional[torch.Tensor] = None,
                context: Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``mask``: the self-attention mask (``Attention.core_attention``); ``context`` and
        ``context_mask``: what cross-attention attends to, and its mask; ``position_ids``: the
        positions of x's tokens (context parallelism, reset positions), for rotary embeddings;
        ``document_ids``: the documents self-attention stays within (``Attention.forward``)."""
        x = self._residual(x, self.norm1, lambda h: self.attention(h, kv_cache, mask, position_ids=position_ids,
                                                                    document_ids=document_ids), self.norm1_out)
        if self.cross:
            x = self._residual(x, self.norm_cross, lambda h: self.cross_attention(h, mask=context_mask, context=context))
        return self._residual(x, self.norm2, self.mlp, self.norm2_out)


class TransformerStack(nn.ModuleDict):
    """A model's (or pipeline stage's) layers, keyed by their global index so that parameter
    names are the whole model's logical names at any layout (``layers.7.mlp.fc1.weight``).
    ``forward`` runs them in order, with full recomputation as ``cfg`` configures it (training
    only); keyword arguments reach every layer."""

    def __init__(self, cfg: TransformerConfig, ps: ParallelState, indices, device=None,
                 backend: Optional["Backend"] = None, **block_kwargs):
        backend = backend or LOCAL
        super().__init__({str(i): Block(cfg, ps, device, backend=backend, moe=i in cfg.moe_layers, layer=i,
                                        **block_kwargs) for i in indices})
        self.cfg = cfg
        self.runner = backend.stack_runner(cfg, ps)  # the backend's layout and FP8 autocast

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        layers = [partial(block, **kwargs) for block in self.values()] if kwargs else list(self.values())
        return self.runner(lambda h: run_stack(self.cfg, layers, h, self.training), x,
                           generating=kwargs.get("kv_cache") is not None)


# The local implementation as one row of the backend table (``models.backends``) ----------------
def run_in_order(run, x: torch.Tensor, generating: bool = False) -> torch.Tensor:
    """How the local stack runs its layers: on x as it comes, [b, s, h]."""
    return run(x)


@dataclass(frozen=True)
class Backend:
    """The classes a block is built from: Megatron-Core's layer spec, kept to one row of a table
    (``models.backends.BACKENDS``, keyed by ``model.transformer_impl``)."""

    name: str
    norm: Callable[..., nn.Module]  # (cfg, device): a norm that stands alone (the final norm)
    input_norm: Callable[..., nn.Module]  # (cfg, device): before attention and MLP (Identity where they fuse it)
    attention: Callable[..., nn.Module]  # (cfg, ps, device, causal=...)
    mlp: Callable[..., nn.Module]  # (cfg, ps, device)
    # cfg -> {block-relative parameter name: the local parameters it holds, stacked along dim 0}
    parameter_map: Callable[[TransformerConfig], Dict[str, Tuple[str, ...]]]
    # (cfg, ps) -> runner(run, x, generating): how a stack's layers run (layout, FP8 autocast)
    stack_runner: Callable
    moe: Optional[Callable[..., nn.Module]] = None  # (cfg, ps, device): a Mixture-of-Experts MLP, if any


LOCAL = Backend("local", build_norm, build_norm, Attention, MLP, lambda cfg: {}, lambda cfg, ps: run_in_order)


def check_backend(cfg: TransformerConfig, backend: Backend) -> None:
    if backend.name != cfg.transformer_impl:
        raise ValueError(f"model.transformer_impl={cfg.transformer_impl} but the block is built with the "
                         f"{backend.name} layers: pass models.backends.backend_for(cfg)")


def mark_logical(block: nn.Module, parameter_map: Dict[str, Tuple[str, ...]]) -> None:
    """Tag each parameter of ``block`` that ``parameter_map`` names with its block-relative name
    and the local parameters it holds (``p.logical``; read by ``models.backends.logical_parameters``)."""
    params = dict(block.named_parameters())
    for name, parts in parameter_map.items():
        if name in params:
            params[name].logical = (name, parts)
