"""BERT: a bidirectional encoder with a masked-LM head and an optional sentence-order head.

What differs from GPT, and nothing else: attention is not causal but sees a padding mask;
embeddings add token types (segments A/B) and are layer-normed; each layer normalises *after*
its residual sum (post-LN, as the original BERT and Hugging Face's ``BertModel``: the shared
``Block`` with ``post_norm``); the masked-LM head is
dense + activation + layer norm, then logits from the tied word embedding plus a bias; the
binary head reads the first ([CLS]) token through a tanh pooler.

Pipeline stages are this class built with a range of layers, as for GPT: the padding mask (and
the other per-sample inputs) reach every stage as keyword arguments; the last stage keeps its
own copy of the tied word embedding, summed with the first stage's by ``parallel.pipeline``.
Sequence parallelism is not supported (``config.derive`` refuses it).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.models.transformer import TransformerStack, build_norm
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hydra.parallel.layers import (PositionEmbedding, VocabParallelEmbedding, replicated, sharded_param,
                                            vocab_parallel_logits)
from megatron_hydra.parallel.random import dropout
from megatron_hydra.parallel.state import ParallelState


class MLMHead(nn.Module):
    """dense -> activation -> layer norm; logits come from the word embedding plus ``bias``
    (vocab-parallel, padded like the embedding)."""

    def __init__(self, cfg: TransformerConfig, ps: ParallelState, device=None):
        super().__init__()
        self.dense = replicated(nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=cfg.params_dtype, device=device))
        self.norm = build_norm(cfg, device)
        self.bias = sharded_param((cfg.padded_vocab_size,), 0, ps.tp_group, cfg.params_dtype, device)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(x), approximate=self.approximate))


class BertModel(nn.Module):
    def __init__(self, cfg: TransformerConfig, ps: ParallelState, layers: Optional[Sequence[int]] = None,
                 pre_process: bool = True, post_process: bool = True, device=None):
        super().__init__()
        self.cfg, self.ps = cfg, ps
        self.pre_process, self.post_process = pre_process, post_process
        kw = dict(dtype=cfg.params_dtype, device=device)
        if pre_process or post_process:  # the last stage's copy is the tied MLM decoder
            self.embedding = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, ps.tp_group,
                                                    tied=True, pipeline_copy=not pre_process, **kw)
        if pre_process:
            self.position_embedding = PositionEmbedding(cfg.max_position_embeddings, cfg.hidden_size, **kw)
            self.token_type_embedding = replicated(nn.Embedding(cfg.num_tokentypes, cfg.hidden_size, **kw))
            self.embedding_norm = build_norm(cfg, device)
        layers = range(cfg.num_layers) if layers is None else layers
        self.layers = TransformerStack(cfg, ps, layers, device, causal=False, post_norm=True)
        if post_process:
            self.lm_head = MLMHead(cfg, ps, device)
            if cfg.binary_head:
                self.pooler = replicated(nn.Linear(cfg.hidden_size, cfg.hidden_size, **kw))
                self.binary_head = replicated(nn.Linear(cfg.hidden_size, 2, **kw))

    def embed(self, tokens: torch.Tensor, token_types: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embedding(tokens) + self.position_embedding(tokens.shape[1])
        x = x + self.token_type_embedding(torch.zeros_like(tokens) if token_types is None else token_types)
        return dropout(self.embedding_norm(x), self.cfg.hidden_dropout, self.training, False)

    def encode(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
               token_types: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This stage's layers over tokens (first stage) or the previous stage's hidden state.
        ``padding_mask`` [batch, seq]: 1 for real tokens, 0 for padding (never attended to)."""
        mask = None if padding_mask is None else padding_mask.bool()[:, None, None, :]
        x = self.embed(x, token_types) if self.pre_process else x
        return self.layers(x, mask=mask)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This TP rank's vocabulary shard of the masked-LM logits; padded entries are -inf."""
        return vocab_parallel_logits(self.lm_head(hidden), self.embedding.weight, self.ps.tp_group, False,
                                     self.cfg.vocab_size, bias=self.lm_head.bias)

    def binary_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Sentence-order logits [batch, 2] from the first ([CLS]) token."""
        return self.binary_head(torch.tanh(self.pooler(hidden[:, 0])))

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None,
                padding_mask: Optional[torch.Tensor] = None, token_types: Optional[torch.Tensor] = None,
                sop_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Without ``labels``: the masked-LM logits shard (or, before the last stage, the hidden
        state). With them: [batch, seq + 1], the per-token masked-LM loss and, in the last
        column, each sample's sentence-order loss (zero without the binary head). One tensor,
        because a pipeline stage hands exactly one to the loss; ``bert_loss`` reduces it."""
        x = self.encode(tokens, padding_mask, token_types)
        if not self.post_process:
            return x
        logits = self.lm_logits(x)
        if labels is None:
            return logits
        lm_loss = vocab_parallel_cross_entropy(logits, labels, self.ps.tp_group, inplace=True)
        if self.cfg.binary_head:
            sop = F.cross_entropy(self.binary_logits(x), sop_labels, reduction="none")
        else:
            sop = lm_loss.new_zeros(lm_loss.shape[0])
        return torch.cat([lm_loss, sop.unsqueeze(1)], dim=1)


def bert_loss(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's BERT loss of a micro-batch: the masked-LM loss averaged over the masked
    positions, plus the sentence-order loss averaged over the samples."""
    mask = loss_mask.to(per_token.dtype)
    return (per_token[:, :-1] * mask).sum() / mask.sum() + per_token[:, -1].mean()
