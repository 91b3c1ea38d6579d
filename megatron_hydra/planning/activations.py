"""What a rank keeps for backward per micro-batch: one Transformer layer, the embedding and the
head. The memory plan (``planning.memory``) and each family's layout of them
(``planning.memory_archs``) both build on these, so they live below both.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models"). Per layer and micro-batch, s = sequence, b = micro-batch, h = hidden, a = heads,
t = tp, the paper's bytes (16-bit activations, 1-byte dropout masks) are

    no parallelism                 sbh (34 + 5as/h)
    tensor parallel                sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel     sbh/t (34 + 5as/h)
    selective recompute (+SP)      34 sbh/t
    full recompute                 2 sbh per checkpointed input (/t with SP)

``activation_bytes_per_layer`` computes them from their terms, with v the bytes of an activation
value and m those of a dropout-mask element (r = 1/t under SP, else 1; g query groups, d head
size, f ffn size):

    norm inputs (2)                2 v sbh r
    QKV and fc1 inputs             2 v sbh r      (r = 1 under SP with ``sp_gathered_inputs``)
    hidden-dropout masks (2)       2 m sbh r      (0 without hidden dropout)
    Q, K, V                        v sb (a + 2g) d / t
    attention-projection input     v sb a d / t
    MLP                            v sb f x 2 / t (gated: x 4: gate, act(gate), up, product;
                                   ReLU: x 1, its output is both what it saves and fc2's input)
    rotary (RoPE) Q and K          v sb (a + g) d / t (rotated copies; the unrotated QKV output stays
                                   alive as V's base; measured by the dry run)
    core attention, unfused        a s^2 b (2v + m) / t   (v without attention dropout)

For f = 4h, g = a, d = h/a, v = 2, m = 1 these sum to the paper's rows. Selective recompute drops
the core-attention term (its inputs Q, K, V stay); full recompute keeps one input per checkpointed
region and adds, once per rank, the replay of one region in backward (its layers' full activations).

Conventions of the plan (how this code runs): v = itemsize(params dtype), activations run in it.
m = 1 on GPU (fused dropout keeps a boolean mask), m = v on CPU (its dropout keeps the scaled mask in
the activation dtype). Core attention is ``F.scaled_dot_product_attention``: on GPU, and on CPU
without attention dropout, a fused (flash-style) kernel keeps only its log-sum-exp (4 a s b / t)
besides Q, K, V and its output, which is the projection's input already counted, instead of the
s^2 terms; on CPU with attention dropout torch's unfused path keeps exactly the paper's terms.
Under SP our column-parallel layers keep their all-gathered input for backward (Megatron
re-gathers it), so those two inputs count at full size.
"""

from __future__ import annotations

from typing import Optional

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.planning import context_parallel


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: Optional[str] = None,
                               ffn_hidden: Optional[int] = None, query_groups: Optional[int] = None,
                               kv_channels: Optional[int] = None, gated: bool = False, relu: bool = False,
                               value_bytes: int = 2, mask_bytes: int = 1, hidden_dropout: bool = True,
                               attention_dropout: bool = True, attention: str = "unfused",
                               sp_gathered_inputs: bool = False, rotary: bool = False, cp: int = 1,
                               cp_comm: str = "p2p", document_mask: bool = False) -> float:
    """Bytes one Transformer layer keeps for backward per micro-batch (module docstring). The
    defaults are the paper's assumptions; ``recompute='full'`` gives what a checkpointed region
    keeps (its input). ``attention``: unfused (the paper) or fused (a flash-style kernel);
    ``document_mask``: attention within documents (``parallel.document_masks``). With
    context parallelism ``cp`` the rank holds s/cp of the ``seq`` tokens, whose queries attend to
    all ``seq`` keys (``planning.context_parallel``)."""
    s, b, h, a, t, v = seq, micro_batch, hidden, heads, tp, value_bytes
    q = s / cp  # the tokens (and queries) this rank holds
    qbh, r = q * b * h, (1.0 / tp if sequence_parallel else 1.0)
    if recompute == "full":
        return v * qbh * r
    f = 4 * h if ffn_hidden is None else ffn_hidden
    g = a if query_groups is None else query_groups
    d = h // a if kv_channels is None else kv_channels
    inputs_r = 1.0 if sequence_parallel and sp_gathered_inputs else r
    total = 2 * v * qbh * r + 2 * v * qbh * inputs_r + (2 * mask_bytes * qbh * r if hidden_dropout else 0)
    total += v * q * b * ((a + 2 * g) * d + a * d + f * (4 if gated else 1 if relu else 2)) / t
    if rotary:  # the rotated Q and K are new tensors; V, a view of the QKV output, keeps all of it alive
        total += v * q * b * (a + g) * d / t
    total += context_parallel.layer_extra_bytes(cp, cp_comm, rotary, tokens=q * b, heads=a, kv_channels=d, tp=t, value_bytes=v)
    if recompute == "selective" and cp == 1:
        return total
    if document_mask:  # the additive mask the kernel keeps, [b, 1, queries, keys]: Ulysses' gathers all queries
        total += v * b * s * (s if cp_comm == "a2a" else q)
    if attention == "fused" or cp > 1:  # context-parallel attention is never replayed: it keeps its lse
        return total + 4 * a * q * b / t
    return total + a * q * s * b * (2 * v + mask_bytes if attention_dropout else v) / t


def embedding_bytes(tc: TransformerConfig, shape: dict, tokens: float, tp: int) -> float:
    """What an embedding over ``tokens`` per sample keeps per micro-batch: the ids and the dropout mask."""
    r = 1.0 / tp if tc.sequence_parallel else 1.0
    b, h = shape["micro_batch"], shape["hidden"]
    return 8 * tokens * b + (shape["mask_bytes"] * tokens * b * h * r if tc.hidden_dropout > 0 else 0)


def head_bytes(tc: TransformerConfig, shape: dict, tokens: float, tp: int) -> float:
    """What the final norm, the LM head and the loss over ``tokens`` per sample keep per micro-batch."""
    r = 1.0 / tp if tc.sequence_parallel else 1.0
    b, h, v = shape["micro_batch"], shape["hidden"], shape["value_bytes"]
    return v * tokens * b * h * r + v * tokens * b * h + v * tokens * b * tc.padded_vocab_size / tp + 8 * tokens * b
