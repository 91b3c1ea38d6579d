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
    rotary at given positions      2 v sb d: the cos and sin gathered at the batch's position ids
                                   (packed documents restart them: SFT, preference pairs), where
                                   the plain case reads views of the tables
    core attention, unfused        a s^2 b (2v + m) / t   (v without attention dropout)

The architecture keys of today's open models (docs/models.md) add, per layer:

    post-sub-layer norms (2)       2 v sbh r      (their inputs: the attention and MLP outputs)
    QK-norm                        4 sb (a + g) / t  (the fp32 statistic of each head's row; its
                                   input is a view of the QKV output, which stays alive; without
                                   RoPE its outputs are new tensors like the rotated ones)
    zero-centred norms             v x the width of each norm (the (1 + w) each norm keeps); below
                                   float32, each keeps its input widened to float32 instead (4 - v
                                   more bytes an element: the norm runs in float32, as Gemma's does;
                                   for QK-norm the dry run measures it on Q's heads only)
    sliding window (w < s)         v s^2: the mask the memory-efficient kernel keeps, [1, 1, s, s]
    soft-capped scores             a s^2 b / t x (v + w + v): the capped scores tanh keeps, the
                                   softmax's output in w = max(v, 4) bytes, its cast to v for the
                                   value matmul (once when w = v); + s^2 bytes of boolean mask

A masked kernel (a window or documents, no cap) reads grouped-query K and V repeated to the a
heads: it keeps those two copies (2 v sb a d / t) in place of the rotated K, and the QKV output
is released unless QK-norm (or Q without RoPE) keeps it. The soft-capped path reads them per
group. The per-row statistics of the norms over the hidden size (4 bytes a row) are left out, as
the paper leaves them.

For f = 4h, g = a, d = h/a, v = 2, m = 1 these sum to the paper's rows. Selective recompute drops
the core-attention term (its inputs Q, K, V stay) and adds, once per rank, its replay in one
layer's backward; full recompute keeps one input per checkpointed region and adds, once per rank,
the replay of one region in backward (its layers' full activations).

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
                               cp_comm: str = "p2p", document_mask: bool = False, qk_norm: bool = False,
                               post_norms: bool = False, zero_centered: bool = False, window: bool = False,
                               softcap: bool = False, positions: bool = False) -> float:
    """Bytes one Transformer layer keeps for backward per micro-batch (module docstring). The
    defaults are the paper's assumptions; ``recompute='full'`` gives what a checkpointed region
    keeps (its input). ``attention``: unfused (the paper) or fused (a flash-style kernel);
    ``document_mask``: attention within documents (``parallel.document_masks``). With
    context parallelism ``cp`` the rank holds s/cp of the ``seq`` tokens, whose queries attend to
    all ``seq`` keys (``planning.context_parallel``). ``qk_norm``, ``post_norms``,
    ``zero_centered``: those norms; ``window``: this layer's window binds (shorter than ``seq``);
    ``softcap``: its scores are soft-capped; ``positions``: the batch carries position ids."""
    s, b, h, a, t, v = seq, micro_batch, hidden, heads, tp, value_bytes
    q = s / cp  # the tokens (and queries) this rank holds
    qbh, r = q * b * h, (1.0 / tp if sequence_parallel else 1.0)
    if recompute == "full":
        return v * qbh * r
    f = 4 * h if ffn_hidden is None else ffn_hidden
    g = a if query_groups is None else query_groups
    d = h // a if kv_channels is None else kv_channels
    inputs_r = 1.0 if sequence_parallel and sp_gathered_inputs else r
    norms = 4 if post_norms else 2
    total = norms * v * qbh * r + 2 * v * qbh * inputs_r + (2 * mask_bytes * qbh * r if hidden_dropout else 0)
    repeated = (cp == 1 and g < a and attention == "fused" and (window or document_mask) and not softcap
                and recompute != "selective")
    qkv = _qkv_heads(a, g, t, rotary, qk_norm, repeated)
    total += v * q * b * (qkv * d + a * d + f * (4 if gated else 1 if relu else 2)) / t
    if qk_norm:
        total += 4 * q * b * (a + g) / t
    if zero_centered:
        total += v * (norms * h + (2 * d if qk_norm else 0))
        if v < 4:  # models.norms: a zero-centred norm keeps its input widened to float32
            total += (4 - v) * (norms * qbh * r + (q * b * a * d / t if qk_norm else 0))  # Q's heads: as measured
    total += context_parallel.layer_extra_bytes(cp, cp_comm, rotary, tokens=q * b, heads=a, kv_channels=d, tp=t, value_bytes=v)
    if rotary and positions and cp == 1:  # at cp > 1 the rank's positions are gathered anyway (above)
        total += 2 * v * q * b * d
    if recompute == "selective" and cp == 1:
        return total
    if cp == 1 and softcap:
        return total + _capped_scores_bytes(q, s, b, a, t, v, mask_bytes, attention_dropout, document_mask)
    if document_mask:  # the additive mask the kernel keeps, [b, 1, queries, keys]: Ulysses' gathers all queries
        total += v * b * s * (s if cp_comm == "a2a" else q)
    elif window and cp == 1:  # the window's mask, [1, 1, queries, keys], in the kernel's dtype
        total += v * q * s
    if attention == "fused" or cp > 1:  # context-parallel attention is never replayed: it keeps its lse
        return total + 4 * a * q * b / t
    return total + a * q * s * b * (2 * v + mask_bytes if attention_dropout else v) / t


def _qkv_heads(a: int, g: int, t: int, rotary: bool, qk_norm: bool, repeated: bool) -> float:
    """Heads' worth (x v s b d / t) of Q, K and V a layer keeps (module docstring): the QKV output
    while a view of it is kept (V's, QK-norm's inputs, an unrotated Q); the query heads gathered
    from several local groups into a copy, when QK-norm or the kernel keeps that copy; the rotated
    (or normalised) Q and K; K and V repeated to every head by a masked kernel, which then keeps
    them in place of the rotated K and of V."""
    new_qk = rotary or qk_norm
    q_copy = g / t > 1 and a > g  # a flatten over several groups' query heads copies them
    q_view_kept = not new_qk and not q_copy
    heads = float(a + 2 * g) if not repeated or qk_norm or q_view_kept else 0.0
    heads += a if q_copy and (qk_norm or not new_qk) else 0
    heads += (a + (0 if repeated else g)) if new_qk else 0
    return heads + (2 * a if repeated else 0)


def _capped_scores_bytes(q: float, s: int, b: int, a: int, t: int, v: int, m: int, dropout: bool,
                         documents: bool) -> float:
    """What soft-capped attention (``parallel.document_masks``, in plain ops) keeps of its
    [b, a/t, q, s] scores (module docstring), and its boolean mask ([b, 1, q, s] with documents)."""
    w = max(v, 4)  # the softmax runs in float32 at least
    per_score = v + w + (v if v != w or dropout else 0) + (m if dropout else 0)
    return a * q * s * b * per_score / t + q * s * (b if documents else 1)


def embedding_bytes(tc: TransformerConfig, shape: dict, tokens: float, tp: int) -> float:
    """What an embedding over ``tokens`` per sample keeps per micro-batch: the ids and the dropout mask."""
    r = 1.0 / tp if tc.sequence_parallel else 1.0
    b, h = shape["micro_batch"], shape["hidden"]
    return 8 * tokens * b + (shape["mask_bytes"] * tokens * b * h * r if tc.hidden_dropout > 0 else 0)


def head_bytes(tc: TransformerConfig, shape: dict, tokens: float, tp: int) -> float:
    """What the final norm, the LM head and the loss over ``tokens`` per sample keep per micro-batch;
    a final-logit cap keeps its slope, 1 - tanh^2, beside the capped logits the loss keeps."""
    r = 1.0 / tp if tc.sequence_parallel else 1.0
    b, h, v = shape["micro_batch"], shape["hidden"], shape["value_bytes"]
    logits = v * tokens * b * tc.padded_vocab_size / tp * (2 if tc.final_logit_softcapping else 1)  # + the cap's slope
    return v * tokens * b * h * r + v * tokens * b * h + logits + 8 * tokens * b + (v * h + max(0, 4 - v) * tokens * b * h * r if tc.zero_centered_gamma else 0)
