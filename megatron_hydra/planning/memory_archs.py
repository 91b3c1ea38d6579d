"""What the memory plan (``planning.memory``) needs to know of each model family (``model.arch``):
which model a chunk's parameters are counted on, which stacks of layers a chunk runs, and what
the embedding and the head keep outside the layers. The byte rules (``planning.state_bytes``) and
the per-layer formula (``planning.activations``) are shared; this module only says how each
family is put together from them.

GPT (and Llama, MoE): one stack of ``activation_bytes_per_layer`` layers per chunk; the embedding
keeps the token ids and its dropout mask, the head its norm and logits inputs and what the loss
keeps of the logits.

BERT (``models.bert``): the same layers (post-LN keeps the same two norm inputs per layer, at the
same sizes), bidirectional over a [b, 1, 1, s] padding mask (a few bytes per layer). Outside the
layers, with s sequence, b micro-batch, h hidden, v and m the activation and dropout-mask bytes:

    first stage   GPT's (token ids, dropout mask) + token-type ids 8 sb + padding mask 8 sb
                  + the embedding norm's input v sbh
    last stage    GPT's head (its last-norm term is the MLM head's norm input) + the MLM dense
                  layer's input and its GELU's input, 2 v sbh; with the binary head, the pooler
                  and binary head's inputs on the [CLS] token, 2 v bh

T5 (``models.t5``, one chunk: no pipeline parallelism): an encoder stack of ``num_layers`` GPT
layers over the s = ``seq_length`` encoder tokens and a decoder stack of ``num_decoder_layers``
layers over the t = ``decoder_seq_length`` decoder tokens, each a GPT layer at t plus its
cross-attention (``cross_attention_bytes``): the norm's and the query projection's inputs and the
dropout mask (2 v tbh + m tbh), the query v tb a d / tp, its keys and values over the encoder's
tokens v sb 2 g d / tp, the projection's input v tb a d / tp and the fused kernel's log-sum-exp
4 a t b / tp (unfused: a t s b (2 v + m) / tp, v without attention dropout). The key/value
projections' input is the encoder output, kept once for all decoder layers. ReLU FFNs keep one
f-wide tensor per layer, not two (``relu`` in the per-layer formula). Outside the layers:

    embeddings    token ids 8 sb + 8 tb, dropout masks m (s + t) bh
    attention     the additive masks every layer reads, kept once: the encoder's position bias
                  plus padding mask v b (a/tp) s^2, the decoder's bias plus causal mask
                  v (a/tp) t^2, the bucket indices their bias tables were gathered with 8 (s^2 + t^2);
                  and, the bias being trained, the encoder mask's gradient, summed over its layers
                  in the backward while the encoder's activations are still kept, v b (a/tp) s^2
    encoder end   the final norm's input, its dropout mask and the output the decoder attends to:
                  2 v sbh + m sbh
    head          GPT's head over the t decoder tokens (the loss runs there), plus the final
                  dropout mask m tbh

With recompute the checkpointed input of each region is kept per stack, and the backward replay
is one region of either stack, whichever is larger.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Tuple

from megatron_hydra.config.derive import Derived
from megatron_hydra.config.schema import RunConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.planning import frozen
from megatron_hydra.planning.activations import activation_bytes_per_layer, embedding_bytes, head_bytes
from megatron_hydra.planning.state_bytes import buffer_bytes


@dataclass(frozen=True)
class StackBytes:
    """Layers of one kind in a model chunk and what one of them keeps per micro-batch: without
    recompute, with selective recompute, and as a fully checkpointed region's input."""

    layers: int
    full: float
    selective: float
    checkpointed: float


def chunk_parameters(tcfg: TransformerConfig, num_layers: int, pre: bool, post: bool) -> Tuple[Tuple[int, bool, bool], ...]:
    """(elements, TP-sharded, LoRA adapter) of each parameter of a chunk, in parameter order, built
    on the meta device at tp=1 with the family's own model class (``models.archs``). T5 is one
    whole model."""
    return _chunk_tensors(tcfg, num_layers, pre, post)[0]


def chunk_buffer_bytes(tcfg: TransformerConfig, num_layers: int, pre: bool, post: bool) -> int:
    """Bytes of the buffers of the same chunk (the rotary tables of each layer's attention), which
    every TP rank holds whole."""
    return _chunk_tensors(tcfg, num_layers, pre, post)[1]


@lru_cache(maxsize=None)
def _chunk_tensors(tcfg: TransformerConfig, num_layers: int, pre: bool, post: bool):
    from megatron_hydra.models.archs import ARCHS
    from megatron_hydra.parallel.lora import is_adapter
    from megatron_hydra.parallel.state import ParallelState

    build, ps = ARCHS[tcfg.arch].build, ParallelState.single()
    if tcfg.arch == "t5":
        model = build(tcfg, ps, device="meta")
    else:
        model = build(tcfg, ps, layers=range(num_layers), pre_process=pre, post_process=post, device="meta")
    params = tuple((p.numel(), getattr(p, "tp_partition_dim", None) is not None, is_adapter(p))
                   for p in model.parameters())
    return params, buffer_bytes(model)


def cross_attention_bytes(seq: int, context_seq: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                          query_groups: int, kv_channels: int, value_bytes: int, mask_bytes: int,
                          hidden_dropout: bool, attention_dropout: bool, attention: str, recompute=None,
                          **_) -> float:
    """Bytes a decoder layer's cross-attention keeps per micro-batch beyond a GPT layer's
    (module docstring); ``seq`` decoder tokens attend to ``context_seq`` encoder tokens."""
    if recompute == "full":
        return 0.0  # the region's input is the layer's, counted once
    t, s, b, h, a, v, d = seq, context_seq, micro_batch, hidden, heads, value_bytes, kv_channels
    total = 2 * v * t * b * h + (mask_bytes * t * b * h if hidden_dropout else 0)
    total += v * b * (2 * t * a * d + 2 * s * query_groups * d) / tp
    if recompute == "selective":
        return total
    if attention == "fused":
        return total + 4 * a * t * b / tp
    return total + a * t * s * b * (2 * v + mask_bytes if attention_dropout else v) / tp


def stacks(tc: TransformerConfig, layer: dict, num_layers: int, first: int = 0) -> List[StackBytes]:
    """The stacks of a chunk of ``num_layers`` layers from global layer ``first``, in the order
    they run (T5, one chunk: its ``num_layers`` encoder layers, then all ``num_decoder_layers``
    decoder layers). A GPT chunk's layers may differ (sliding-window layers keep their mask):
    its stack holds their mean."""
    def stack(n: int, shape: dict, extra=lambda **kw: 0.0) -> StackBytes:
        return StackBytes(n, *(activation_bytes_per_layer(**{**shape, "recompute": rc})
                               + extra(**{**shape, "recompute": rc}) for rc in (None, "selective", "full")))

    if tc.arch != "t5":
        windowed = sum(_binds(tc.windowed(i), layer["seq"]) for i in range(first, first + num_layers))
        def lora(recompute=None, **shape) -> float:  # what LoRA changes (0 without it)
            return frozen.layer_bytes(tc, shape, recompute)

        kinds = [(n, stack(n, {**layer, "window": w}, lora)) for n, w in ((num_layers - windowed, False), (windowed, True))
                 if n]
        return [StackBytes(num_layers, *(sum(n * getattr(k, key) for n, k in kinds) / max(1, num_layers)
                                         for key in ("full", "selective", "checkpointed")))]
    decoder = {**layer, "seq": tc.decoder_seq_length}
    return [stack(num_layers, layer),
            stack(tc.num_decoder_layers, decoder, lambda **kw: cross_attention_bytes(**kw, context_seq=layer["seq"]))]


def _binds(window, seq: int) -> bool:
    """Whether a layer's sliding window masks any key of a ``seq``-token sequence."""
    return window is not None and window < seq


def outside_layers(cfg: RunConfig, derived: Derived, shape: dict) -> Tuple[float, float]:
    """Bytes per micro-batch kept by the embedding (first stage) and by the head + loss (last)."""
    tc = derived.transformer
    s, b, h, v, m = shape["seq"] / derived.cp, shape["micro_batch"], shape["hidden"], shape["value_bytes"], shape["mask_bytes"]
    drop = tc.hidden_dropout > 0
    if tc.arch == "gpt":
        embedding = embedding_bytes(tc, shape, s, derived.tp)
        first, last = frozen.outside_bytes(tc, shape, embedding, s)  # LoRA: the frozen ends keep less
        if tc.recompute_granularity != "full":  # the first layer, unless it is a checkpointed region
            first += frozen.first_layer_bytes(tc, {**shape, "window": _binds(tc.windowed(0), shape["seq"])})
        return embedding + first, head_bytes(tc, shape, s, derived.tp) + last
    if tc.arch == "bert":
        embedding = embedding_bytes(tc, shape, s, derived.tp) + 16 * s * b + v * s * b * h
        head = head_bytes(tc, shape, s, derived.tp) + 2 * v * s * b * h + (2 * v * b * h if tc.binary_head else 0)
        return embedding, head
    t, heads = tc.decoder_seq_length, tc.num_attention_heads / derived.tp
    embedding = embedding_bytes(tc, shape, s, derived.tp) + embedding_bytes(tc, shape, t, derived.tp)
    masks = v * heads * (2 * b * s * s + t * t) + 8 * (s * s + t * t)
    encoder_end = 2 * v * s * b * h + (m * s * b * h if drop else 0)
    head = head_bytes(tc, shape, t, derived.tp) + (m * t * b * h if drop else 0)
    return embedding + masks + encoder_end, head
