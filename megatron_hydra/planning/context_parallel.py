"""Context parallelism (``parallel.context_parallel_size = c``) in the plans: the bytes of its
buffers (``planning.memory``) and the seconds of its communication (``planning.performance``).

Each of the c ranks of a CP group holds s/c tokens of every sequence (chunks i and 2c - 1 - i of
2c, the causal load balanced); under sequence parallelism each TP rank then holds 1/t of those
outside attention. Parameters are not split by c; gradients are reduced over the d x c ranks that
hold the same weights. Ranks are laid out tp innermost, then cp, then dp, then pp (rank =
((pp_rank d + dp_rank) c + cp_rank) t + tp_rank): a CP group's members are t ranks apart and span
t c consecutive ranks, so it runs on NVLink when t c fits in a node, else on InfiniBand.

Notation: micro-batch b, sequence s, heads a, query groups g, head size k, tensor-parallel size t,
element bytes e (the activation dtype). Per TP rank a K/V block of one CP rank is

    kv_block = 2 b (s/c) (g/t) k e        (K and V of the rank's s/c tokens)

Memory (bytes a rank holds besides its activations, once per rank: one layer's attention runs at
a time, and its buffers are free before the next layer's starts):

    p2p (ring)   4 kv_block: in backward the K/V block being computed on (also the one being sent)
                 and the one arriving, plus the dK/dV accumulator of that block and the one arriving
                 (the forward needs only the first two). The rank's own K/V are activations already.
                 The merged output and log-sum-exp of the forward are left out (one Q block's size).
    a2a (Ulysses) 4 b (a/(t c)) s k e: q, k, v and the output re-laid out from [b, a/t, s/c, k] to
                 [b, a/(t c), s, k] (the same element count), or in backward dout, dq, dk, dv. K and
                 V are counted with the query heads: Ulysses must repeat the groups whenever g/t is
                 not a multiple of c (derive requires only a/t to be).

The per-layer activations of ``planning.memory`` are those of a rank holding s/c tokens: every
term per token divides by c; the attention terms scale with the rank's queries (s/c) times the
full key length s (the unfused a s^2 terms become a (s/c) s, i.e. also 1/c; the fused kernel's
log-sum-exp 4 a (s/c) b / t). So a rank's activations are exactly 1/c of those at c = 1.

Step time, per layer and micro-batch on one GPU (``T(x)``: x bytes over the group's link at
``link_efficiency`` plus one ``latency_s``). The forward attention of the rank's s/c queries
against all s keys is 1/c of the whole sequence's attention at this t; split over the c K/V blocks,
one block costs ``A_blk = A / c`` where ``A`` is the rank's attention forward (matmuls and the
memory-bound softmax, each already 1/c of the sequence's): 1/c^2 of the whole sequence's attention.

    p2p   forward: c - 1 exchanges of one kv_block, each hidden behind one block's attention:
              exposed (c - 1) max(0, T(kv_block) - A_blk)
          backward: c - 1 steps moving the K/V block and the dK/dV accumulator (twice the volume)
              behind twice the compute, then one more hop home for the dK/dV accumulators:
              exposed (c - 1) max(0, 2 T(kv_block) - 2 A_blk) + T(kv_block)
          full recompute replays the forward, ring included; selective recompute does not
          replay context-parallel attention (``models.transformer.Attention``).
          A sliding window w < s leaves the blocks unequal: the ring skips the pairs of chunks
          outside the window, while every K/V block still travels. Step i of rank r then computes
          ``A_blk w_ri`` (``ring_step_weights``: the query-key pairs the window keeps in that
          step, over their mean), and each step hides the next transfer behind its own compute:
          exposed max_r sum_i max(0, T(kv_block) - A_blk w_ri) forward, likewise backward.
    a2a   4 all-to-alls forward (q, k, v in, the output back) and 4 in backward, each moving
          (c - 1)/c of a local tensor of b (s/c) (a/t) k e bytes per GPU, not overlapped; 4 more
          when recompute replays the attention.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from megatron_hydra.config.derive import Derived
from megatron_hydra.config.schema import RunConfig

COMM_TYPES = ("p2p", "a2a")
# The sequence length from which the layout planner searches context parallelism and the fit check
# suggests it: below it a sequence's activations are small next to the weights, and every CP degree
# multiplies the layouts to check.
LONG_SEQUENCE = 8192


def kv_block_bytes(micro_batch: int, seq: int, cp: int, query_groups: int, kv_channels: int, tp: int,
                   value_bytes: int) -> float:
    """K and V of one CP rank's s/c tokens on one TP rank."""
    return 2 * micro_batch * seq / cp * query_groups / tp * kv_channels * value_bytes


def a2a_tensor_bytes(micro_batch: int, seq: int, cp: int, heads: int, kv_channels: int, tp: int,
                     value_bytes: int) -> float:
    """One of q, k, v or the output on one TP rank: [b, a/t, s/c, k] before the all-to-all,
    [b, a/(t c), s, k] after it."""
    return micro_batch * seq / cp * heads / tp * kv_channels * value_bytes


def buffer_bytes(cp: int, comm_type: str, *, micro_batch: int, seq: int, heads: int, query_groups: int,
                 kv_channels: int, tp: int, value_bytes: int) -> int:
    """The CP buffers one rank holds at its peak (module docstring), counted once per rank."""
    if cp == 1:
        return 0
    if comm_type == "p2p":
        return round(4 * kv_block_bytes(micro_batch, seq, cp, query_groups, kv_channels, tp, value_bytes))
    if comm_type == "a2a":
        return round(4 * a2a_tensor_bytes(micro_batch, seq, cp, heads, kv_channels, tp, value_bytes))
    raise ValueError(f"cp_comm_type {comm_type!r} is not one of {COMM_TYPES}")


def rank_buffer_bytes(cfg: RunConfig, derived: Derived) -> int:
    """``buffer_bytes`` of a rank of the run ``cfg`` (the plan's ``cp bufs``)."""
    tc = derived.transformer
    return buffer_bytes(derived.cp, tc.cp_comm_type, micro_batch=cfg.data.micro_batch_size, seq=tc.seq_length,
                        heads=tc.num_attention_heads, query_groups=tc.num_query_groups, kv_channels=tc.kv_channels,
                        tp=derived.tp, value_bytes=tc.params_dtype.itemsize)


def layer_extra_bytes(cp: int, comm_type: str, rotary: bool, *, tokens: float, heads: int, kv_channels: int,
                      tp: int, value_bytes: int) -> float:
    """What one layer keeps at cp > 1 besides 1/cp of its cp = 1 activations (``tokens`` = b s/c,
    measured by the dry run): rotary embeddings gather cos and sin at the rank's positions (at
    cp = 1 they are views of the table), and a2a keeps attention's output in the head layout
    besides the projection's input."""
    if cp == 1:
        return 0.0
    gathered = 2 * value_bytes * tokens * kv_channels if rotary else 0.0
    relaid = value_bytes * tokens * heads * kv_channels / tp if comm_type == "a2a" else 0.0
    return gathered + relaid


def a2a_bytes_per_gpu(cp: int, tensor_bytes: float) -> float:
    """Bytes one GPU sends in the forward's four all-to-alls of one layer and micro-batch."""
    return 4 * (cp - 1) / cp * tensor_bytes


def ring_seconds(cp: int, kv_transfer_s: float, block_attention_s: float, replays: int,
                 weights: Optional[Sequence[Sequence[float]]] = None) -> Tuple[float, float]:
    """(raw, exposed) seconds of the ring's exchanges per layer and micro-batch: ``kv_transfer_s``
    moves one K/V block, ``block_attention_s`` is one block's forward attention on average, and
    ``weights[r][i]`` scales it for rank r's step i (``ring_step_weights``; None: every block
    alike); ``replays`` forwards run again in backward (recompute). The slowest rank counts."""
    if cp == 1:
        return 0.0, 0.0
    steps = cp - 1
    forward_raw = steps * kv_transfer_s
    backward_raw = steps * 2 * kv_transfer_s + kv_transfer_s
    forwards = 1 + replays
    exposed = 0.0
    for row in weights or [[1.0] * cp]:
        hiding = [block_attention_s * w for w in row[:steps]]  # step i's compute hides transfer i + 1
        forward = sum(max(0.0, kv_transfer_s - a) for a in hiding)
        backward = sum(max(0.0, 2 * kv_transfer_s - 2 * a) for a in hiding) + kv_transfer_s
        exposed = max(exposed, forwards * forward + backward)
    return forwards * forward_raw + backward_raw, exposed


def ring_step_weights(cp: int, seq: int, window: Optional[int]) -> Optional[List[List[float]]]:
    """[r][i]: the causal query-key pairs within ``window`` that rank r attends at ring step i
    (K/V of rank (r - i) mod cp, balanced layout), over their mean across ranks and steps. None
    when no window binds (every block alike, the module's plain model)."""
    if cp == 1 or window is None or window >= seq:
        return None
    chunk = seq // (2 * cp)
    pairs = [[sum(_pairs_within((a - b) * chunk, chunk, window)
                  for a in (rank, 2 * cp - 1 - rank)
                  for b in ((rank - step) % cp, 2 * cp - 1 - (rank - step) % cp))
              for step in range(cp)] for rank in range(cp)]
    mean = sum(map(sum, pairs)) / cp ** 2
    return [[n / mean for n in row] for row in pairs]


def _pairs_within(offset: int, chunk: int, window: int) -> int:
    """Pairs (query x, key y) of two chunks whose starts lie ``offset`` positions apart with
    0 <= offset + x - y < window. The gap g = offset + x - y is shared by chunk - |g - offset|
    pairs: sum that over the gaps kept, two arithmetic series either side of g = offset."""
    first, last = max(0, offset - chunk + 1), min(window - 1, offset + chunk - 1)
    total = 0
    rising_end = min(last, offset)  # g <= offset: chunk - offset + g pairs
    if rising_end >= first:
        n = rising_end - first + 1
        total += n * (chunk - offset) + (first + rising_end) * n // 2
    falling_start = max(first, offset + 1)  # g > offset: chunk + offset - g pairs
    if last >= falling_start:
        n = last - falling_start + 1
        total += n * (chunk + offset) - (falling_start + last) * n // 2
    return total


def a2a_seconds(cp: int, tensor_bytes: float, transfer: Callable[[float], float], replays: int) -> float:
    """Seconds of the all-to-alls per layer and micro-batch (none overlapped): 4 forward, 4 backward,
    4 per replayed forward; ``transfer(x)`` is one collective moving x bytes per GPU."""
    if cp == 1:
        return 0.0
    return (8 + 4 * replays) * transfer((cp - 1) / cp * tensor_bytes)
