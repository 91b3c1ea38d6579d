"""The one config object model code sees: concrete numbers only, nothing left to derive."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TransformerConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    seq_length: int
    max_position_embeddings: int
    vocab_size: int  # the tokenizer's vocabulary
    padded_vocab_size: int  # a multiple of make_vocab_size_divisible_by * tp
    position_embedding: str = "learned"
    rope_theta: float = 10000.0
    normalization: str = "layernorm"
    norm_eps: float = 1e-5
    activation: str = "gelu"
    add_bias_linear: bool = True
    tie_embeddings: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32

    @property
    def output_init_std(self) -> float:
        """Megatron scales the init of the projections that write into the residual stream by
        1/sqrt(2 * layers), so the residual's variance does not grow with depth."""
        return self.init_std / (2.0 * self.num_layers) ** 0.5
