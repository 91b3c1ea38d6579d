"""The layer stacks a step-time estimate runs over (``planning.performance``): per kind of layer
(GPT's and BERT's one stack; T5's encoder and decoder), the forward FLOPs of its projections and
attention per token, its residual branches, the tokens of its tensor-parallel all-reduces and its
weights; and which attention keys the fused and plain kernels compute (windows, soft caps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.planning.flops import window_keys


def mlp_units(tc: TransformerConfig) -> int:
    return 3 if tc.activation in ("swiglu", "geglu") else 2


def moe_fraction(tc: TransformerConfig) -> float:
    """The share of layers whose MLP is a Mixture of Experts."""
    return len(tc.moe_layers) / tc.num_layers if tc.moe is not None else 0.0


def mlp_widths(tc: TransformerConfig) -> tuple:
    """(ffn width a token runs through in a dense layer, in an MoE layer: k experts + shared)."""
    moe = tc.moe
    routed = moe.top_k * moe.ffn_hidden_size + moe.shared_ffn_hidden_size if moe is not None else 0
    return tc.ffn_hidden_size, routed


def projection_flops_per_token(tc: TransformerConfig) -> tuple:
    """Forward matmul FLOPs per token of (QKV, attention output, MLP in, MLP out), averaged over
    the layers (MoE layers: the router with the MLP input, the experts a token runs through)."""
    h, k, a, g = tc.hidden_size, tc.kv_channels, tc.num_attention_heads, tc.num_query_groups
    dense_f, moe_f = mlp_widths(tc)
    x = moe_fraction(tc)
    router = 2 * h * tc.moe.num_experts if tc.moe is not None else 0
    width = (1 - x) * dense_f + x * moe_f
    units = mlp_units(tc)
    return (2.0 * h * (a + 2 * g) * k, 2.0 * a * k * h, 2.0 * (units - 1) * h * width + x * router, 2.0 * h * width)


@dataclass(frozen=True)
class LayerStack:
    """Layers of one kind that every sample runs through (``planning.performance``'s docstring, "Model families"):
    per layer and per token of the stack, the forward FLOPs of its projections and of its
    attention matmuls, its residual branches (each a norm and a dropout-add), the tokens per
    sample of each tensor-parallel all-reduce of its forward and of its backward, and its weights."""

    layers: int
    tokens: int  # per sample: the stack's own tokens (queries)
    projections: Tuple[float, ...]
    attention: float  # as the model FLOPs count it (``planning.flops``), averaged over the layers
    branches: int
    tp_forward: Tuple[int, ...]
    tp_backward: Tuple[int, ...]
    params: float  # per layer, dense (MoE experts: ``_params_per_gpu``)
    attention_fused: float  # what the fused kernels compute (flash: causal half; masked: every score)
    attention_plain: float  # what the layers whose capped scores run in plain ops compute
    attention_dense: float  # what an unfused kernel computes: every score, masked or not
    capped: float  # the share of the layers whose scores are soft-capped


def layer_stacks(tc: TransformerConfig) -> Tuple[LayerStack, ...]:
    """GPT and BERT: one stack over the sequence. T5: its encoder over the ``s`` encoder tokens and
    its decoder over the ``t`` decoder tokens, whose cross-attention adds per layer a query and an
    output projection per decoder token, the key/value projection of the ``s`` encoder tokens,
    ``4 s a k`` attention FLOPs per decoder token, a third branch, and a third all-reduce each way
    plus, backward, one over the encoder tokens (the gradient of the encoder output)."""
    h, k, a, g = tc.hidden_size, tc.kv_channels, tc.num_attention_heads, tc.num_query_groups
    units, x, moe = mlp_units(tc), moe_fraction(tc), tc.moe
    params = h * (a + 2 * g) * k + a * k * h + (1 - x) * units * h * tc.ffn_hidden_size
    if moe is not None:
        params += x * (h * moe.num_experts + units * h * moe.shared_ffn_hidden_size)
    s = tc.seq_length
    counted, fused, plain = attention_keys(tc)
    own = LayerStack(tc.num_layers, s, projection_flops_per_token(tc), 4 * a * k * counted, 2, (s, s), (s, s), params,
                     4 * a * k * fused, 4 * a * k * plain, float(4 * s * a * k), plain / s)
    if tc.arch != "t5":
        return (own,)
    t = tc.decoder_seq_length
    cross = (2.0 * h * a * k, 2.0 * a * k * h, 2.0 * h * 2 * g * k * s / t)  # per decoder token: query, output, K/V
    attention = float(4 * (t + s) * a * k)
    decoder = LayerStack(tc.num_decoder_layers, t, own.projections + cross, attention, 3, (t, t, t),
                         (t, t, t, s), params + 2 * h * a * k + 2 * h * g * k, attention, 0.0, attention, 0.0)
    return own, decoder


def attention_keys(tc: TransformerConfig) -> tuple:
    """Keys per query, averaged over the layers of a GPT or BERT stack: (as the model FLOPs count
    them, as the fused kernels compute them, as plain ops compute them) (``planning.performance``'s docstring)."""
    computed = [computed_keys(tc, i) for i in range(tc.num_layers)]
    counted = sum(window_keys(tc.seq_length, tc.windowed(i)) for i in range(tc.num_layers))
    return tuple(x / tc.num_layers for x in (counted, sum(f for f, _ in computed), sum(p for _, p in computed)))


def computed_keys(tc: TransformerConfig, layer: int) -> tuple:
    """(keys a fused kernel computes, keys plain ops compute) per query of ``layer`` on a GPU with
    flash attention: a causal flash kernel half the sequence, a masked one (binding window) all of
    it, soft-capped scores all of it in plain ops."""
    s = tc.seq_length
    if tc.attn_logit_softcapping is not None:
        return 0.0, float(s)
    if window_keys(s, tc.windowed(layer)) < s or tc.arch != "gpt":
        return float(s), 0.0
    return 0.5 * s, 0.0
