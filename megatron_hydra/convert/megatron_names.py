"""Megatron-Core's tensor names and layouts <-> our logical tensors (GPT models).

Megatron-Core names a GPT model's tensors ``embedding.word_embeddings.weight``,
``decoder.layers.<i>.self_attention.linear_qkv.weight``, ``decoder.final_layernorm.weight``,
``output_layer.weight``. Its conventions, and how each meets ours:

- **Fused QKV**: per query group, the group's query heads, then its key, then its value: the
  layout of our ``attention.qkv``, so the rows are taken as they are. A TP shard holds whole
  groups, so the shards of a legacy checkpoint concatenate into the same tensor.
- **SwiGLU's fc1**: gate and up projections fused in ``linear_fc1``, the gate first (Megatron
  applies the activation to the first half). ``torch_dist`` stores the logical tensor
  ``[gate; up]`` whatever the TP degree (Megatron-Core's ``apply_swiglu_sharded_factory`` places
  each rank's two halves apart); a legacy TP shard holds ``[gate_r; up_r]``, its own rows of each.
  Ours keeps ``mlp.gate`` and ``mlp.fc1`` (up) apart.
- **Norms**: the local layer spec's ``input_layernorm`` / ``pre_mlp_layernorm`` are, in
  Transformer Engine's fused layers and in every ``torch_dist`` checkpoint of Megatron-Core 0.16,
  ``self_attention.linear_qkv.layer_norm_weight`` / ``mlp.linear_fc1.layer_norm_weight``: both
  names are read; the fused ones are written.
- **Vocabulary**: word embeddings and output layer are padded to Megatron's multiple; their real
  rows are ours (each run pads to its own multiple).
- **Tensor parallelism** (legacy shards): column-parallel layers split their rows (QKV, fc1,
  embeddings, output layer), row-parallel ones their columns (proj, fc2); the rest is replicated.
- **Layers**: ``torch_dist`` stacks every layer's tensor into one (``decoder.layers.<name>``, the
  layer the first dim) unless saved per layer (``decoder.layers.<i>.<name>``); legacy files
  number each pipeline stage's layers from 0.

Every source tensor must be read by some tensor of ours (``ignorable`` lists the exceptions): a
tensor left over belongs to a feature the arguments did not reveal, and dropping it silently
would give another model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_hydra.errors import ConfigError

DECODER_LAYERS = "decoder.layers."
EXTRA_STATE = "_extra_state"

# A layer's tensors: Megatron's name (after decoder.layers.<i>.) -> ours (after layers.<i>.).
LAYER_NAMES: Dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "norm1.weight",
    "self_attention.linear_qkv.layer_norm_bias": "norm1.bias",
    "self_attention.linear_qkv.weight": "attention.qkv.weight",
    "self_attention.linear_qkv.bias": "attention.qkv.bias",
    "self_attention.linear_proj.weight": "attention.proj.weight",
    "self_attention.linear_proj.bias": "attention.proj.bias",
    "self_attention.q_layernorm.weight": "attention.q_norm.weight",
    "self_attention.q_layernorm.bias": "attention.q_norm.bias",
    "self_attention.k_layernorm.weight": "attention.k_norm.weight",
    "self_attention.k_layernorm.bias": "attention.k_norm.bias",
    "mlp.linear_fc1.layer_norm_weight": "norm2.weight",
    "mlp.linear_fc1.layer_norm_bias": "norm2.bias",
    "mlp.linear_fc1.weight": "mlp.fc1.weight",
    "mlp.linear_fc1.bias": "mlp.fc1.bias",
    "mlp.linear_fc2.weight": "mlp.fc2.weight",
    "mlp.linear_fc2.bias": "mlp.fc2.bias",
}
# The local layer spec's names of the norms (its legacy state dicts), read as the fused ones.
LOCAL_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
OUTER_NAMES: Dict[str, str] = {
    "embedding.word_embeddings.weight": "embedding.weight",
    "embedding.position_embeddings.weight": "position_embedding.weight",
    "decoder.final_layernorm.weight": "final_norm.weight",
    "decoder.final_layernorm.bias": "final_norm.bias",
    "output_layer.weight": "output_weight",
}
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
# The dim a tensor-parallel rank holds a slice of (legacy shards); absent: replicated.
TP_DIM = {"self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0,
          "self_attention.linear_proj.weight": 1, "mlp.linear_fc1.weight": 0, "mlp.linear_fc1.bias": 0,
          "mlp.linear_fc2.weight": 1, "embedding.word_embeddings.weight": 0, "output_layer.weight": 0}


def ignorable(key: str, tied: bool) -> bool:
    """A source tensor an import may leave unread: a layer's ``_extra_state`` (Transformer Engine's
    FP8 metadata, empty in the local spec), a rotary table (``rotary_pos_emb.inv_freq``: computed
    from the arguments), and, with tied embeddings, the last pipeline stage's copy of the word
    embeddings (``output_layer.weight``)."""
    return EXTRA_STATE in key or "rotary_pos_emb." in key or (tied and key == "output_layer.weight")


def canonical(name: str) -> str:
    """A layer tensor's name (after ``decoder.layers.<i>.``) as Megatron-Core 0.16 writes it."""
    return LOCAL_NORMS.get(name, name)


def split_layer(key: str) -> Optional[Tuple[int, str]]:
    """``(layer, name)`` of ``decoder.layers.<i>.<name>``; None for any other key."""
    if not key.startswith(DECODER_LAYERS):
        return None
    index, _, name = key[len(DECODER_LAYERS):].partition(".")
    return (int(index), canonical(name)) if index.isdigit() and name else None


@dataclass(frozen=True)
class Part:
    """Where one of our logical tensors is in Megatron's: the tensor ``key`` (a layer's name after
    ``decoder.layers.<i>.``, with ``layer``; else a whole key), and which half of a fused SwiGLU
    fc1 (``half`` 0: gate, 1: up; None: all of it)."""

    key: str
    layer: Optional[int] = None
    half: Optional[int] = None

    @property
    def tp_dim(self) -> Optional[int]:
        return TP_DIM.get(self.key)


def parts(ours: List[str], gated: bool) -> Dict[str, Part]:
    """Where each of our logical tensors ``ours`` comes from in a Megatron GPT model (``gated``:
    SwiGLU, its fc1 fused); a tensor without a Megatron counterpart is one line naming it."""
    ours_to_layer = {v: k for k, v in LAYER_NAMES.items()}
    ours_to_outer = {v: k for k, v in OUTER_NAMES.items()}
    out = {}
    for name in ours:
        head, _, rest = name.partition(".")
        index, _, tail = rest.partition(".")
        if gated and tail.startswith("mlp.gate."):  # SwiGLU's gate: the first half of linear_fc1
            tail = tail.replace("mlp.gate.", "mlp.fc1.")
            half = 0
        else:
            half = 1 if gated and tail.startswith("mlp.fc1.") else None
        if head == "layers" and index.isdigit() and tail in ours_to_layer:
            out[name] = Part(ours_to_layer[tail], int(index), half)
        elif name in ours_to_outer:
            out[name] = Part(ours_to_outer[name])
        else:
            raise ConfigError(f"tensor {name} of this model has no counterpart in Megatron-Core's GPT model: "
                              "only dense GPT models convert")
    return out
