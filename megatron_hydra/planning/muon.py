"""Muon (``optim=muon``) in the plans: what its state takes, what its step allocates for a moment,
its Newton-Schulz FLOPs and the tensor-parallel all-gather it needs. ``planning.memory`` and
``planning.performance`` ask here.

Which parameters. Muon steps the hidden 2-D matrices of the transformer layers (QKV, the attention
output projection, fc1, gate and fc2 of the dense MLP, of a shared expert and of every expert,
each expert's matrix on its own); AdamW steps the rest (embeddings, the LM head, norms, biases,
routers). The plan asks the optimizer's own rule (``parallel.muon.is_muon_param``) of each
parameter of the meta build of a chunk.

State. Muon keeps one momentum buffer per matrix where Adam keeps two moments, in the same dtype
(fp32 for 16-bit runs, the parameter dtype otherwise), over the same elements a rank holds (its TP
shard): with ``M`` of a rank's ``N`` trained elements stepped by Muon, its optimizer state is
``(2 N - M) x item`` instead of ``2 N x item``.

The step (``parallel.muon``). Newton-Schulz orthogonalises the *logical* matrix: every
tensor-parallel rank casts its shard of a matrix's update to the Newton-Schulz dtype ``v`` (bf16
on a GPU, the main dtype ``e`` on a CPU), all-gathers the shards and runs the iterations on the
whole matrix, then keeps its own slice. For an ``m x n`` matrix (``m <= n``, transposed otherwise)
an iteration computes ``A = X X^T`` (``2 m^2 n`` FLOPs), ``B = b A + c A A`` (``2 m^3``) and
``X = a X + B X`` (``2 m^2 n``): ``ns_steps (4 m^2 n + 2 m^3)`` FLOPs per matrix and step, on
every TP rank (and on every data-parallel rank, which all step the same matrices). A rank receives
``(t - 1)/t m n v`` bytes per sharded matrix, one all-gather each. The step's transient peaks at
one matrix (they are stepped one after another, in parameter order): beside the previous matrix's
update (its local slice in ``e``, or where ``v = e`` a view that keeps the whole result) lie the
Nesterov update of the local shard ``l e`` (``l = m n / t`` when gathered, else ``m n``), its cast
``l v`` (where ``v != e``, or where columns are split and the shard is copied rows first for the
gather), for a gathered matrix the whole ``m n v``, then the largest of: the normalised input ``m n v``, the iteration's working
set (``NS_MATRICES``, ``NS_GRAMS``), the scaled result beside the unscaled one ``2 m n v``, and the
result beside its slice in ``e``. Experts are orthogonalised one at a time and their updates
stacked.

With the distributed optimizer (``parallel.muon_owned``) each data-parallel rank owns whole
matrices: the momentum of a rank is that of the matrices it owns (``owned_elements``: the worst
rank's, as ``assign_owners`` deals them), Adam leaves out the rank's 1/dp of the Muon matrices,
Newton-Schulz runs on the owners only (the step time takes the busiest owner's), and the buckets
holding Muon matrices cross the network twice more per step (``ownership_bytes``). Dense buckets
are dealt over dp x cp, then expert buckets over the expert data-parallel group, each padded to
its group's size (``distributed_optimizer_state``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple

import torch

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.planning.layer_stacks import mlp_units, moe_fraction
from megatron_hydra.planning.state_bytes import HALF, shape_only

# The Newton-Schulz iteration's working set at its two peaks, (m x n tensors, m x m tensors):
# building B = b A + (c A) A beside X and a X (A, b A, c A, (c A) A), and summing a X + B X
# beside the Gram matrix A (X, a X, B X, the sum).
NS_MATRICES = (2, 4)
NS_GRAMS = (4, 1)


@dataclass(frozen=True)
class Matrix:
    """``count`` logical ``rows x cols`` matrices stepped by Muon (``count`` experts of a stacked
    expert parameter, else 1); ``split_dim``: the dimension (0 rows, 1 columns) tensor-parallel
    ranks split, None if whole; ``expert``: an expert's."""

    rows: int
    cols: int
    count: int
    split_dim: Optional[int]
    expert: bool

    @property
    def sharded(self) -> bool:
        return self.split_dim is not None

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


@lru_cache(maxsize=None)
def chunk_matrices(tcfg: TransformerConfig, first: int, last: int, pre: bool, post: bool, ep: int = 1) -> Tuple[Matrix, ...]:
    """Muon's matrices in the chunk of layers ``[first, last)`` of EP rank 0 (``E / ep`` experts),
    logical (tp 1), from the meta build of the family's model (T5: the whole model)."""
    from megatron_hydra.parallel.data_parallel import is_expert
    from megatron_hydra.parallel.muon import is_muon_param

    out = []
    for name, p in _meta_chunk(tcfg, first, last, pre, post, ep).named_parameters():
        expert = is_expert(p)
        if is_muon_param(name, p):
            rows, cols = p.shape[-2:]
            dim = getattr(p, "tp_partition_dim", None)
            out.append(Matrix(rows, cols, p.shape[0] if expert else 1, None if dim is None else dim - expert, expert))
    return tuple(out)


def _meta_chunk(tcfg: TransformerConfig, first: int, last: int, pre: bool, post: bool, ep: int):
    """The meta build of the chunk of layers ``[first, last)`` of EP rank 0, logical (tp 1)."""
    from megatron_hydra.models.archs import ARCHS
    from megatron_hydra.parallel.state import AXES, ParallelState

    ps = ParallelState(sizes={**{a: 1 for a in AXES}, "dp": ep}, ep=ep) if ep > 1 else ParallelState.single()
    build = ARCHS[tcfg.arch].build
    if tcfg.arch == "t5":
        return build(tcfg, ps, device="meta")
    return build(tcfg, ps, layers=range(first, last), pre_process=pre, post_process=post, device="meta")


@lru_cache(maxsize=None)
def chunk_flags(tcfg: TransformerConfig, first: int, last: int, pre: bool, post: bool,
                ep: int = 1) -> Tuple[Tuple[int, bool, bool, bool], ...]:
    """``(logical elements, split over TP, stepped by Muon, an expert's)`` of each trained
    parameter of a chunk of EP rank 0 (``chunk_matrices``), in the model's parameter order."""
    from megatron_hydra.parallel.data_parallel import is_expert
    from megatron_hydra.parallel.muon import is_muon_param

    return tuple((p.numel(), getattr(p, "tp_partition_dim", None) is not None, is_muon_param(name, p), is_expert(p))
                 for name, p in _meta_chunk(tcfg, first, last, pre, post, ep).named_parameters() if p.requires_grad)


def _group_state(params: List[Tuple[int, bool]], bucket_size: int, ranks: int) -> List[int]:
    """Optimizer-state elements of each of ``ranks`` for one reduction group's ``params``
    (``(elements, Muon's)`` in model order): Adam's two moments over the non-Muon elements of its
    shard of each bucket (buffer order, each bucket padded to ``ranks``) and the momentum of the
    Muon matrices it owns (``parallel.muon_owned.assign_owners``)."""
    from megatron_hydra.parallel.data_parallel import bucket_layout

    owned = owner_loads([n for n, muon in params if muon], ranks)
    ordered = list(reversed(params))  # the buffer runs in reverse order
    adam = [0] * ranks
    for lo, hi, start, end in bucket_layout([n for n, _ in ordered], bucket_size, ranks) if ordered else ():
        share, at = (end - start) // ranks, start
        for n, muon in ordered[lo:hi]:
            for r in range(ranks) if not muon else ():
                adam[r] += max(0, min(at + n, start + (r + 1) * share) - max(at, start + r * share))
            at += n
    return [2 * a + o for a, o in zip(adam, owned)]


def distributed_optimizer_state(tcfg: TransformerConfig, chunks, tp: int, dp: int, bucket_size: int, item: int,
                                ep: int = 1, expert_dp: Optional[int] = None, whole_experts: bool = False,
                                cp: int = 1) -> int:
    """The optimizer state of the busiest rank with Muon under the distributed optimizer, as
    ``parallel.data_parallel`` lays the buffer out (dense buckets over the ``dp`` (dp x cp) ranks,
    then, with ``expert_dp`` given, expert buckets over the expert data-parallel group) and
    ``parallel.muon_owned`` deals the owners (per group). A rank at position ``i`` of dp x cp sits
    at ``(i // (cp ep)) cp + i % cp`` of its expert group (``parallel.state.expert_group_ranks``);
    with whole experts (carved from dp x tp) the busiest of each group is taken, an upper bound."""
    tc = shape_only(tcfg)
    params = [(n // tp if split and not (whole_experts and expert) else n, muon, expert and expert_dp is not None)
              for layers, pre, post in chunks for n, split, muon, expert in chunk_flags(tc, layers.start, layers.stop,
                                                                                         pre, post, ep)]
    dense = _group_state([(n, muon) for n, muon, expert in params if not expert], bucket_size, dp)
    if expert_dp is None:
        return max(dense) * item
    experts = _group_state([(n, muon) for n, muon, expert in params if expert], bucket_size, expert_dp)
    if whole_experts:
        return (max(dense) + max(experts)) * item
    return max(d + experts[(i // (cp * ep)) * cp + i % cp] for i, d in enumerate(dense)) * item


def rank_matrices(tcfg: TransformerConfig, chunks, ep: int = 1) -> List[Matrix]:
    """Muon's matrices of a rank whose model chunks are ``chunks`` (``(layers range, first stage,
    last stage)`` each)."""
    tc = shape_only(tcfg)
    return [m for layers, pre, post in chunks for m in chunk_matrices(tc, layers.start, layers.stop, pre, post, ep)]


def local_elements(matrices: List[Matrix], tp: int, whole_experts: bool = False) -> int:
    """Elements of ``matrices`` a tensor-parallel rank holds (and keeps momentum for)."""
    return sum(m.numel // (tp if m.sharded and not (whole_experts and m.expert) else 1) for m in matrices)


def owner_loads(sizes: List[int], ranks: int) -> List[int]:
    """Elements each of ``ranks`` owns when matrices of ``sizes`` (in parameter order) are dealt
    as ``parallel.muon_owned.assign_owners`` deals them."""
    from megatron_hydra.parallel.muon_owned import assign_owners

    load = [0] * ranks
    for size, rank in zip(sizes, assign_owners(sizes, ranks)):
        load[rank] += size
    return load


def owned_elements(matrices: List[Matrix], tp: int, dp: int, whole_experts: bool = False) -> int:
    """With the distributed optimizer: the momentum elements of the rank that owns the most
    (experts are dealt over the expert data-parallel group: give its size as ``dp`` for them)."""
    return max(owner_loads([m.numel // (tp if m.sharded and not (whole_experts and m.expert) else 1)
                            for m in matrices], dp))


def ownership_bytes(bucket_bytes: int) -> int:
    """Bytes of Muon's ownership collectives per step under the distributed optimizer, beyond
    ZeRO-1's own: each bucket holding a Muon matrix gathered whole once and reduce-scattered
    once (``parallel.muon_owned``); ``bucket_bytes``: those buckets' bytes together. Counted as
    ``collectives.count_comm`` counts (the whole bucket per collective); a ring over ``n`` ranks
    sends ``(n-1)/n`` of this from each rank (``step_seconds``)."""
    return 2 * bucket_bytes


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on one ``rows x cols`` matrix."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def step_flops(matrices: List[Matrix], steps: int) -> float:
    """Newton-Schulz FLOPs of a rank's Muon step: every matrix whole (module docstring)."""
    return sum(m.count * newton_schulz_flops(m.rows, m.cols, steps) for m in matrices)


def gather_bytes(matrices: List[Matrix], tp: int, ns_bytes: int, whole_experts: bool = False) -> float:
    """Bytes a rank receives per step from the TP all-gathers of its matrices' updates (in the
    Newton-Schulz dtype)."""
    if tp == 1:
        return 0.0
    split = [m for m in matrices if m.sharded and not (whole_experts and m.expert)]
    return (tp - 1) / tp * sum(m.numel for m in split) * ns_bytes


def transient_bytes(matrices: List[Matrix], tp: int, main_bytes: int, ns_bytes: int, whole_experts: bool = False) -> int:
    """The Muon step's peak above the bytes live when it starts (module docstring): the matrices
    are stepped one after another in parameter order, each beside the previous one's update."""
    peak, previous = 0, 0
    for m in matrices:
        gathered = tp > 1 and m.sharded and not (whole_experts and m.expert)
        mn = m.rows * m.cols
        local = mn // tp if gathered else mn
        own = _orthogonal_bytes(m, gathered, local, main_bytes, ns_bytes)
        # the update: a copy of the local slice in the main dtype, or (same dtype) a view of the whole result
        update = local * main_bytes if ns_bytes != main_bytes else mn * main_bytes
        if m.expert:  # experts one at a time, their updates kept until they are stacked
            held = previous + m.count * local * main_bytes
            peak = max(peak, held + (m.count - 1) * update + own, held + m.count * (update + local * main_bytes))
            previous = m.count * local * main_bytes
        else:
            peak = max(peak, previous + local * main_bytes + own)
            previous = update
    return peak


def _orthogonal_bytes(m: Matrix, gathered: bool, local: int, main_bytes: int, ns_bytes: int) -> int:
    """Peak bytes of one logical matrix's scaled Newton-Schulz update beside its momentum update:
    the local update cast to the Newton-Schulz dtype, the gathered pieces, then the largest of the
    normalised input, the iteration's working set (``NS_MATRICES``, ``NS_GRAMS``), the scaled
    result beside the unscaled one, and the scaled result beside its local slice in the main dtype."""
    mn, small = m.rows * m.cols, min(m.rows, m.cols)
    # the cast shard (a copy where the dtypes differ, or where columns are split and it moves rows
    # first for the gather) and, gathered, the whole matrix
    shard = local * ns_bytes * (ns_bytes != main_bytes or (gathered and m.split_dim != 0))
    pieces = shard + (mn * ns_bytes if gathered else 0)
    iteration = max(x * mn + g * small * small for x, g in zip(NS_MATRICES, NS_GRAMS)) * ns_bytes
    sliced = mn * ns_bytes + (local * main_bytes if ns_bytes != main_bytes else 0)
    return pieces + max(mn * ns_bytes, iteration, 2 * mn * ns_bytes, sliced)


def main_item(dtype: torch.dtype) -> int:
    """Bytes of an element of the main (optimizer-side) dtype: fp32 for 16-bit parameters."""
    return 4 if dtype in HALF else dtype.itemsize


def ns_item(dtype: torch.dtype, gpu: bool) -> int:
    """Bytes of an element Newton-Schulz runs in: bf16 on a GPU, the main dtype on a CPU."""
    return 2 if gpu else main_item(dtype)


def layer_matrix_shapes(tc: TransformerConfig, split_qkv: bool = False,
                        ep: int = 1) -> List[Tuple[int, int, float, int]]:
    """(rows, cols, matrices per layer, averaged over the layers, experts stacked in one parameter:
    0 for a dense matrix) of Muon's matrices on a GPU, from the config alone (the step-time model,
    which builds nothing). ``split_qkv``: Q, K and V of each query group apart; ``ep``: the
    experts are split over that many ranks."""
    h, d, a, g = tc.hidden_size, tc.kv_channels, tc.num_attention_heads, tc.num_query_groups
    gated = mlp_units(tc) == 3
    qkv = [(a // g * d, h, g, 0), (d, h, 2 * g, 0)] if split_qkv else [((a + 2 * g) * d, h, 1, 0)]
    shapes = qkv + [(h, a * d, 1, 0)]
    moe_share = moe_fraction(tc)
    dense = 1.0 - moe_share
    if dense:
        shapes += [(tc.ffn_hidden_size, h, dense * (2 if gated else 1), 0), (h, tc.ffn_hidden_size, dense, 0)]
    if moe_share:
        spec = tc.moe
        for f, count, stacked in ((spec.ffn_hidden_size, spec.num_experts / ep, max(1, spec.num_experts // ep)),
                                  (spec.shared_ffn_hidden_size, 1, 0)):
            if f:
                shapes += [(f, h, moe_share * count * (2 if gated else 1), stacked), (h, f, moe_share * count, stacked)]
    return shapes


def _busiest_owner_flops(shapes, layers_per_gpu: float, tp: int, steps: int, owners: int, expert_owners: int) -> float:
    """Newton-Schulz FLOPs of the busiest owner: the GPU's matrices (an expert parameter stacks
    its experts) dealt as ``parallel.muon_owned.assign_owners`` deals them, dense ones over
    ``owners``, experts over ``expert_owners`` (the expert data-parallel group)."""
    from megatron_hydra.parallel.muon_owned import assign_owners

    busiest = 0.0
    for group, ranks in ((False, owners), (True, expert_owners)):
        items = []  # (elements on a TP rank, FLOPs) per parameter
        for r, c, k, stacked in shapes:
            if bool(stacked) == group:
                per = stacked or 1
                items += [(per * r * c // tp, per * newton_schulz_flops(r, c, steps))] * round(layers_per_gpu * k / per)
        load = [0.0] * ranks
        for (_, flops), rank in zip(items, assign_owners([n for n, _ in items], ranks)):
            load[rank] += flops
        busiest += max(load)
    return busiest


def step_seconds(tc: TransformerConfig, layers_per_gpu: float, tp: int, steps: int, peak_flops: float,
                 gather_time, split_qkv: bool = False, ep: int = 1, owners: int = 1, expert_owners: int = 1,
                 dp_time=None, grad_bytes: int = 4) -> float:
    """Seconds of a GPU's Muon step beyond AdamW's: Newton-Schulz on its layers' matrices at
    ``peak_flops`` and the TP all-gathers (``gather_time(bytes)``, fp32 updates), not overlapped
    with anything. ``owners`` (``expert_owners`` for experts): the data-parallel ranks that share
    the matrices out under the distributed optimizer (``parallel.muon_owned``), 1 when every rank
    steps every matrix; then Newton-Schulz runs the busiest owner's share, and the buckets holding
    the matrices (taken as the matrices' ``grad_bytes`` elements) are all-gathered and
    reduce-scattered once more over the DP group: ``dp_time(wire bytes, messages)``, a ring
    sending ``(n-1)/n`` of ``ownership_bytes``."""
    shapes = layer_matrix_shapes(tc, split_qkv, ep)
    if owners > 1 or expert_owners > 1:
        flops = _busiest_owner_flops(shapes, layers_per_gpu, tp, steps, owners, expert_owners)
    else:
        flops = layers_per_gpu * sum(k * newton_schulz_flops(r, c, steps) for r, c, k, _ in shapes)
    volume = layers_per_gpu * sum(k * r * c for r, c, k, _ in shapes) * (tp - 1) / tp * 2
    ownership = 0.0
    for group, n in ((False, owners), (True, expert_owners)):
        held = layers_per_gpu * sum(k * r * c for r, c, k, stacked in shapes if bool(stacked) == group) / tp
        if n > 1 and held and dp_time is not None:
            ownership += dp_time((n - 1) / n * ownership_bytes(held * grad_bytes), 2)
    return flops / peak_flops + (gather_time(volume) if tp > 1 else 0.0) + ownership


def optimizer_bytes(trained: int, muon: int, dtype: torch.dtype, shard: Optional[int] = None) -> int:
    """Optimizer state of a rank: Adam's two moments over its ``trained`` (or ``shard``) elements
    but one momentum buffer over the ``muon`` of them Muon steps (module docstring)."""
    held = trained if shard is None else shard
    return (2 * held - muon) * (8 if dtype == torch.float64 else 4)


def plan_note(cfg, derived, rank_chunks: list) -> str:
    """``mode=plan``'s line on Muon: the Newton-Schulz FLOPs and TP all-gather bytes of the busiest
    pipeline rank's step; ``rank_chunks``: each pipeline rank's chunks (``rank_matrices``)."""
    tc, steps = derived.transformer, cfg.optim.muon_ns_steps
    ns = ns_item(tc.params_dtype, cfg.trainer.accelerator == "gpu")
    per_rank = []
    for chunks in rank_chunks:
        matrices = rank_matrices(tc, chunks, derived.ep)
        per_rank.append((step_flops(matrices, steps), gather_bytes(matrices, derived.tp, ns, derived.etp is not None),
                         sum(m.count for m in matrices)))
    flops, gathered, count = max(per_rank)
    if cfg.optim.distributed_optimizer:
        return (f"optim=muon with the distributed optimizer: {count} matrices per pipeline rank, each owned whole by "
                f"one of {derived.dp * derived.cp} data-parallel ranks (its momentum and Newton-Schulz there, "
                f"{flops:.3e} FLOPs per step over them, {steps} iterations); the buckets holding them are gathered and "
                f"reduce-scattered once more per step; TP all-gathers {gathered / 2**20:.2f} MiB per TP group and step")
    return (f"optim=muon: {count} matrices per rank take one momentum buffer each (AdamW's two moments for the rest); "
            f"Newton-Schulz {flops:.3e} FLOPs per step on every rank ({steps} iterations on the logical matrices), "
            f"TP all-gathers {gathered / 2**20:.2f} MiB received per rank and step")
