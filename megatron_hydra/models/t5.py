"""T5: an encoder-decoder with relative position buckets, as Raffel et al. 2020 and Hugging Face's
``T5ForConditionalGeneration``.

What differs from GPT: the encoder's self-attention is bidirectional over a padding mask; each
decoder layer adds cross-attention (``Attention(cross=True)``: queries from the decoder, keys and
values from the encoder's output) between its causal self-attention and its MLP; positions enter
only as a learned bias per (bucket of relative distance, head), one table for the encoder and one
for the decoder, computed once per forward and shared by all layers of the stack (in Hugging Face
it lives in layer 0); attention scores are not scaled by 1/sqrt(d) (``softmax_scale=1``); norms are
RMSNorm without bias and no linear layer has one. The FFN is ReLU (T5 v1.0) or gated GELU (v1.1,
``activation=geglu``). With tied embeddings the decoder output is scaled by d_model**-0.5 before
the logits, as T5 does.

The position bias and the padding / causal masks are summed into one additive mask per
attention, and TP shards the bias table by heads like the attention itself. Pipeline parallelism
and sequence parallelism are not supported (``config.derive`` refuses them).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.models.transformer import TransformerStack, build_norm
from megatron_hydra.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hydra.parallel.layers import VocabParallelEmbedding, sharded_param, vocab_parallel_logits
from megatron_hydra.parallel.random import dropout
from megatron_hydra.parallel.state import ParallelState


def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position (key - query): exact buckets for small distances,
    logarithmic ones up to ``max_distance``; bidirectional tables spend half on each sign."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).long() * num_buckets
        relative = relative.abs()
    else:
        relative = -relative.clamp(max=0)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(relative < max_exact, relative, large)


class RelativePositionBias(nn.Module):
    """The [buckets, heads] bias table, this TP rank's heads only."""

    def __init__(self, cfg: TransformerConfig, ps: ParallelState, bidirectional: bool, device=None):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets, self.max_distance = cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
        self.weight = sharded_param((self.num_buckets, cfg.num_attention_heads), 1, ps.tp_group, cfg.params_dtype, device)

    def forward(self, q_len: int, k_len: int) -> torch.Tensor:
        """[1, local heads, q_len, k_len]."""
        pos = torch.arange(max(q_len, k_len), device=self.weight.device)
        relative = pos[None, :k_len] - pos[:q_len, None]
        bucket = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self.weight[bucket].permute(2, 0, 1).unsqueeze(0)


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``keep``, the dtype's most negative number elsewhere (not -inf: a bias added to it
    stays finite, and a fully masked row gives uniform weights rather than NaN)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


class T5Model(nn.Module):
    def __init__(self, cfg: TransformerConfig, ps: ParallelState, layers=None, pre_process: bool = True,
                 post_process: bool = True, device=None):
        super().__init__()
        if layers is not None or not (pre_process and post_process):
            raise ValueError("T5Model is not split into pipeline stages")
        self.cfg, self.ps = cfg, ps
        self.embedding = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, ps.tp_group,
                                                dtype=cfg.params_dtype, device=device)
        self.encoder_position_bias = RelativePositionBias(cfg, ps, True, device)
        self.encoder = TransformerStack(cfg, ps, range(cfg.num_layers), device, causal=False)
        self.encoder_norm = build_norm(cfg, device)
        self.decoder_position_bias = RelativePositionBias(cfg, ps, False, device)
        self.decoder = TransformerStack(cfg, ps, range(cfg.num_decoder_layers), device, cross=True)
        self.decoder_norm = build_norm(cfg, device)
        if not cfg.tie_embeddings:
            self.output_weight = sharded_param((cfg.padded_vocab_size, cfg.hidden_size), 0, ps.tp_group,
                                               cfg.params_dtype, device)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.cfg.hidden_dropout, self.training, False)

    def encode(self, tokens: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Encoder output [batch, seq, hidden]; ``padding_mask``: 1 for real tokens, 0 for padding."""
        x = self._drop(self.embedding(tokens))
        s = tokens.shape[1]
        mask = self.encoder_position_bias(s, s).to(x.dtype)
        if padding_mask is not None:
            mask = mask + additive_mask(padding_mask.bool()[:, None, None, :], x.dtype)
        x = self.encoder(x, mask=mask)
        return self._drop(self.encoder_norm(x))

    def decode(self, decoder_tokens: torch.Tensor, context: torch.Tensor,
               padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This TP rank's vocabulary shard of the decoder's logits; padded entries are -inf."""
        x = self._drop(self.embedding(decoder_tokens))
        t = decoder_tokens.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        mask = self.decoder_position_bias(t, t).to(x.dtype) + additive_mask(causal, x.dtype)
        keep = torch.ones(context.shape[:2], dtype=torch.bool, device=x.device) if padding_mask is None else padding_mask
        context_mask = additive_mask(keep.bool()[:, None, None, :], x.dtype)
        x = self.decoder(x, mask=mask, context=context, context_mask=context_mask)
        x = self._drop(self.decoder_norm(x))
        if self.cfg.tie_embeddings:
            x = x * self.cfg.hidden_size ** -0.5
        weight = self.embedding.weight if self.cfg.tie_embeddings else self.output_weight
        return vocab_parallel_logits(x, weight, self.ps.tp_group, False, self.cfg.vocab_size)

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None,
                decoder_tokens: Optional[torch.Tensor] = None,
                padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per-token decoder loss [batch, decoder_seq] with ``labels``, else the logits shard."""
        logits = self.decode(decoder_tokens, self.encode(tokens, padding_mask), padding_mask)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.ps.tp_group, inplace=True)
