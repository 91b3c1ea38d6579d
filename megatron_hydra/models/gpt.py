"""GPT: token (+ learned position) embedding, a stack of pre-norm blocks, final norm, LM head.

The model takes a ``TransformerConfig`` and a ``ParallelState`` and nothing else. Parallelism is
hidden in the layers; a pipeline stage is this same class built with only its range of layers
(``layers``) and with the embedding / head only where they belong (first / last stage). Blocks are
keyed by their global index, so parameter names are the logical names of the whole model whatever
the layout: ``layers.7.mlp.fc1.weight`` is the same tensor at any tp or pp.

The vocabulary is padded to a multiple of 128 x tp, so the padding depends on the layout. Padded
rows start at zero and their logits are masked out of the softmax, which makes the loss (and the
sampled tokens) independent of how much padding there is.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from megatron_hydra.models.transformer import Block, build_norm, run_stack
from megatron_hydra.models.transformer_config import TransformerConfig
from megatron_hydra.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hydra.parallel.layers import VocabParallelEmbedding, mask_padded_vocab, parallel_lm_logits, replicated, tp_param
from megatron_hydra.parallel.random import dropout
from megatron_hydra.parallel.state import ParallelState


class GPTModel(nn.Module):
    def __init__(self, cfg: TransformerConfig, ps: ParallelState, layers: Optional[Sequence[int]] = None,
                 pre_process: bool = True, post_process: bool = True, device=None):
        super().__init__()
        self.cfg, self.ps = cfg, ps
        self.pre_process, self.post_process = pre_process, post_process
        layers = range(cfg.num_layers) if layers is None else layers
        if pre_process:
            self.embedding = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, ps.tp_group,
                                                    sequence_parallel=cfg.sequence_parallel,
                                                    dtype=cfg.params_dtype, device=device)
            if cfg.position_embedding == "learned":
                # Under SP each rank looks up only its slice's positions: the grads are summed over TP.
                self.position_embedding = replicated(nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                                                  dtype=cfg.params_dtype, device=device),
                                                     cfg.sequence_parallel)
        self.layers = nn.ModuleDict({str(i): Block(cfg, ps, device) for i in layers})
        if post_process:
            self.final_norm = build_norm(cfg, device)
            if not cfg.tie_embeddings:
                self.output_weight = tp_param((cfg.padded_vocab_size // ps.tp_size, cfg.hidden_size),
                                            cfg.params_dtype, device, 0)
            elif not pre_process:
                # A last pipeline stage keeps its own copy of the tied word embedding (Megatron's
                # scheme): same logical name, so the same initial values; parallel.pipeline sums its
                # grad with the first stage's, and grad clipping counts it once.
                self.embedding = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, ps.tp_group,
                                                        dtype=cfg.params_dtype, device=device)
                self.embedding.weight.shared_embedding_copy = True
        if cfg.tie_embeddings and (pre_process or post_process):
            self.embedding.weight.shared_embedding = True

    def lm_head_weight(self) -> torch.Tensor:
        return self.embedding.weight if self.cfg.tie_embeddings else self.output_weight

    def embed(self, tokens: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
        """[batch, seq, hidden], or this rank's [batch, seq / tp, hidden] slice under SP.
        ``position_offset``: the position of the first token (generation with a KV cache)."""
        x = self.embedding(tokens)
        if self.cfg.position_embedding == "learned":
            start = self.ps.tp_rank * x.shape[1] if self.cfg.sequence_parallel else position_offset
            x = x + self.position_embedding(torch.arange(start, start + x.shape[1], device=tokens.device))
        return dropout(x, self.cfg.hidden_dropout, self.training, sharded=self.cfg.sequence_parallel)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of this TP rank's vocabulary shard, [batch, seq, padded_vocab / tp]; the padded
        entries are -inf."""
        logits = parallel_lm_logits(self.final_norm(x), self.lm_head_weight(), self.ps.tp_group, self.cfg.sequence_parallel)
        return mask_padded_vocab(logits, self.cfg.vocab_size, self.ps.tp_rank)

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None, kv_cache=None) -> torch.Tensor:
        """Per-token loss [batch, seq] when ``labels`` are given, else this rank's logits shard.
        On a pipeline stage without the embedding, ``tokens`` is the hidden state from the
        previous stage; on one without the head, the hidden state is returned. ``kv_cache``
        (generation): ``tokens`` continue the sequence whose keys and values it holds."""
        x = self.embed(tokens, 0 if kv_cache is None else kv_cache.offset) if self.pre_process else tokens
        if kv_cache is None:
            x = run_stack(self.cfg, list(self.layers.values()), x, self.training)
        else:
            for block in self.layers.values():
                x = block(x, kv_cache)
        if not self.post_process:
            return x
        logits = self.head(x)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.ps.tp_group)
