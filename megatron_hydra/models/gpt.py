"""GPT: token (+ learned position) embedding, a stack of pre-norm blocks, final norm, LM head.

The model takes a ``TransformerConfig`` and a ``ParallelState`` and nothing else. Parallelism is
hidden in the layers; a pipeline stage is this same class built with only its range of layers
(``layers``) and with the embedding / head only where they belong (first / last stage). Blocks are
keyed by their global index, so parameter names are the logical names of the whole model whatever
the layout: ``layers.7.mlp.fc1.weight`` is the same tensor at any tp or pp.

The vocabulary is padded to a multiple of 128 x tp, so the padding depends on the layout. Padded
rows start at zero and their logits are masked out of the softmax, which makes the loss (and the
sampled tokens) independent of how much padding there is.

Gemma scales the word embeddings by sqrt(hidden) (``scale_embeddings``) and caps the logits softly
(``final_logit_softcapping`` c: c tanh(logits / c)); padded entries stay -inf under the cap.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import nn

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.models.backends import backend_for
from megatron_hydra.models.transformer import TransformerStack
from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hydra.parallel.layers import PositionEmbedding, VocabParallelEmbedding, sharded_param, vocab_parallel_logits
from megatron_hydra.parallel.random import dropout
from megatron_hydra.parallel.state import ParallelState


class GPTModel(nn.Module):
    def __init__(self, cfg: TransformerConfig, ps: ParallelState, layers: Optional[Sequence[int]] = None,
                 pre_process: bool = True, post_process: bool = True, device=None):
        super().__init__()
        self.cfg, self.ps = cfg, ps
        self.pre_process, self.post_process = pre_process, post_process
        common = dict(dtype=cfg.params_dtype, device=device)
        if pre_process or (post_process and cfg.tie_embeddings):
            self.embedding = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, ps.tp_group,
                                                    sequence_parallel=cfg.sequence_parallel and pre_process,
                                                    tied=cfg.tie_embeddings, pipeline_copy=not pre_process, **common)
        if pre_process and cfg.position_embedding == "learned":
            self.position_embedding = PositionEmbedding(cfg.max_position_embeddings, cfg.hidden_size, ps.tp_group,
                                                        sequence_parallel=cfg.sequence_parallel, **common)
        backend = backend_for(cfg)  # model.transformer_impl
        self.layers = TransformerStack(cfg, ps, range(cfg.num_layers) if layers is None else layers, device, backend)
        if post_process:
            self.final_norm = backend.norm(cfg, device)
            if not cfg.tie_embeddings:
                self.output_weight = sharded_param((cfg.padded_vocab_size, cfg.hidden_size), 0, ps.tp_group, **common)

    def embed(self, tokens: torch.Tensor, position_offset: int = 0,
              position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[batch, seq, hidden], or this rank's [batch, seq / tp, hidden] slice under SP.
        ``position_offset``: the position of the first token (generation with a KV cache), unless
        ``position_ids`` gives every token's (context parallelism: this rank's chunks)."""
        x = self.embedding(tokens)
        if self.cfg.scale_embeddings:  # the factor rounded to x's dtype first, as the reference does
            x = x * torch.full((), math.sqrt(self.cfg.hidden_size), dtype=x.dtype, device=x.device)
        if self.cfg.position_embedding == "learned":
            x = x + self.position_embedding(x.shape[1], position_offset, position_ids)
        return dropout(x, self.cfg.hidden_dropout, self.training, sharded=self.cfg.sequence_parallel)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of this TP rank's vocabulary shard, [batch, seq, padded_vocab / tp]; the padded
        entries are -inf."""
        weight = self.embedding.weight if self.cfg.tie_embeddings else self.output_weight
        logits = vocab_parallel_logits(self.final_norm(x), weight, self.ps.tp_group, self.cfg.sequence_parallel,
                                       self.cfg.vocab_size)
        cap = self.cfg.final_logit_softcapping
        if cap is None:
            return logits
        first_padded = self.cfg.vocab_size - C.group_rank(self.ps.tp_group) * logits.shape[-1]
        return _SoftCap.apply(logits, cap, first_padded)

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None, kv_cache=None,
                position_ids: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per-token loss [batch, seq] when ``labels`` are given, else this rank's logits shard.
        On a pipeline stage without the embedding, ``tokens`` is the hidden state from the
        previous stage; on one without the head, the hidden state is returned. ``kv_cache``
        (generation): ``tokens`` continue the sequence whose keys and values it holds.
        ``position_ids`` ([batch, seq]): the tokens' positions when they are not 0, 1, ... (context
        parallelism hands each rank its chunks of the sequence, ``data.sequence_shards``; positions
        that restart at every document, ``data.reset_position_ids``). ``document_ids`` ([batch,
        seq]): attention stays within each document of a packed sequence (``data.reset_attention_mask``)."""
        offset = 0 if kv_cache is None else kv_cache.offset
        x = self.embed(tokens, offset, position_ids) if self.pre_process else tokens
        x = self.layers(x, kv_cache=kv_cache, position_ids=position_ids, document_ids=document_ids)
        if not self.post_process:
            return x
        logits = self.head(x)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.ps.tp_group, inplace=True)


class _SoftCap(torch.autograd.Function):
    """cap * tanh(logits / cap) over the head's logits, whose entries from ``first_padded`` on stay
    -inf. The head hands its logits over (nothing else reads them), so they are capped in place
    (marked dirty); the backward's factor 1 / cosh^2(logits / cap) is formed from the uncapped
    values (1 - tanh^2 of a rounded tanh cancels near the cap; cosh^-2 keeps its relative
    precision in any dtype), so the cap adds one logits-sized tensor where torch's own ops would
    keep three."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, cap: float, first_padded: int) -> torch.Tensor:
        slope = (logits / cap).cosh_().pow_(-2)  # the one extra tensor: no temporary beside it
        logits.div_(cap).tanh_().mul_(cap)
        if first_padded < logits.shape[-1]:
            logits[..., max(first_padded, 0):] = float("-inf")
        ctx.mark_dirty(logits)
        ctx.save_for_backward(slope)
        return logits

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (slope,) = ctx.saved_tensors
        return grad * slope, None, None
