"""The memory plan's Mixture-of-Experts arithmetic (``planning.memory`` calls it for ``model.moe``).

Parameters (exact). A pipeline rank's chunks are built on the meta device with their global layer
indices (``TransformerConfig.moe_layers`` names global layers) and this rank's E / ep experts per
MoE layer. Expert parameters (``parallel.data_parallel.is_expert``) sit in buckets of their own,
after the dense ones in the same flat buffer, reduced over the expert data-parallel group of
dp x cp / ep ranks; under the distributed optimizer each of those buckets is padded to a multiple
of that group's size and its shard is 1/(dp x cp / ep) of it. The plan lays the buffer out with
``parallel.data_parallel.split_layout``, the function the run's ``GradBuffer`` calls, so padding and
shards are the run's.

Activations per MoE layer and micro-batch, in place of the dense MLP's terms (its fc1 input and
hidden tensors), what the layer keeps for backward (measured on the real layer with a saved-tensor
hook and by the dry run). T tokens of the micro-batch on this rank (s b / cp; T r of them routed
here under SP, r = 1/t), k = top_k, E experts, f the expert ffn size, v the activation bytes,
w = max(v, 4) the router's (fp32 for 16-bit models):

    router input (cast to its dtype)           w T r h
    logits, scores, probabilities              3 w T r E
    routing weights and indices (small)        4 (T k + 2 T r + T k) + 8 T k (x 3, x 5 at ep > 1)
    permuted tokens (the experts' input)       v T k h
    experts' hidden tensors                    v T k f x 2 / t (gated: x 4)
    experts' output, and its cast for combine  v T k h + w T k h
    shared expert (if any): a dense MLP        v T h + v T f_s x 2 / t (gated: x 4)

Balanced routing is assumed (each expert gets T k / E of a rank's assignments; real loads vary
around it, and so does the memory of each EP rank's experts); the totals over experts do not
depend on ep. Under LoRA the experts are frozen and have no adapters; these terms stay those of
trained experts (``planning.frozen``). Under full recomputation a recomputed MoE layer keeps only its input like a dense
one, and its replay adds these terms.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Tuple

from megatron_hydra.config.derive import Derived
from megatron_hydra.config.schema import RunConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.parallel.pipeline import stage_indices, stage_layers
from megatron_hydra.planning import frozen
from megatron_hydra.planning.state_bytes import GATED_ACTIVATIONS, buffer_bytes, shape_only, state_bytes


class _Numel:
    """A parameter as ``split_layout`` sees it: its element count."""

    def __init__(self, n: int):
        self.n = n

    def numel(self) -> int:
        return self.n


def chunk_ranges(cfg: RunConfig, derived: Derived, pp_rank: int) -> List[range]:
    """Global layer indices of each model chunk of pipeline rank ``pp_rank`` (``rank_chunks``' order)."""
    per_stage = derived.layers_per_stage
    if derived.pp == 1:
        return [range(sum(per_stage))]
    stages = stage_indices(pp_rank, derived.pp, derived.vpp, cfg.parallel.pipeline_schedule)
    return [stage_layers(per_stage, s) for s in stages]


@lru_cache(maxsize=None)
def _chunk_params(tcfg: TransformerConfig, first: int, last: int, pre: bool, post: bool,
                  ep: int) -> Tuple[Tuple[int, bool, bool], ...]:
    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.parallel.data_parallel import is_expert
    from megatron_hydra.parallel.lora import is_adapter
    from megatron_hydra.parallel.state import AXES, ParallelState

    ps = ParallelState(sizes={**{a: 1 for a in AXES}, "dp": ep}, ep=ep)  # EP rank 0: E / ep experts
    model = GPTModel(tcfg, ps, layers=range(first, last), pre_process=pre, post_process=post, device="meta")
    params = tuple((p.numel(), getattr(p, "tp_partition_dim", None) is not None, is_expert(p),
                    tcfg.lora is None or is_adapter(p)) for p in model.parameters())
    return params, buffer_bytes(model)


def chunk_params(tcfg: TransformerConfig, layers: range, pre: bool, post: bool, tp: int,
                 ep: int, whole_experts: bool = False, trains: Optional[bool] = None) -> List[Tuple[int, bool]]:
    """(elements on one TP rank, is an expert parameter) of a chunk's parameters, in model order.
    ``whole_experts``: the experts are not split over TP (``expert_tensor_parallel_size=1``);
    ``trains``: only those that train (True) or only LoRA's frozen base (False), else all."""

    held = _chunk_params(shape_only(tcfg), layers.start, layers.stop, pre, post, ep)[0]
    return [(n // tp if sharded and not (whole_experts and expert) else n, expert)
            for n, sharded, expert, trained in held if trains is None or trained == trains]


def chunk_buffer_bytes(tcfg: TransformerConfig, layers: range, pre: bool, post: bool, ep: int) -> int:
    """Bytes of the buffers of the same chunk (``planning.state_bytes.buffer_bytes``)."""
    return _chunk_params(shape_only(tcfg), layers.start, layers.stop, pre, post, ep)[1]


def expert_dp_size(derived: Derived) -> Optional[int]:
    """Ranks holding the same experts (their gradients reduce over them): dp x cp / ep, times tp
    for whole experts (``ParallelState.expert_dp_group``); None when experts reduce like dense
    parameters (ep 1, experts split like the dense MLP)."""
    whole = derived.etp is not None
    if derived.ep == 1 and not whole:
        return None
    return derived.dp * derived.cp * (derived.tp if whole else 1) // derived.ep


def flat_buffer(params: List[Tuple[int, bool]], bucket_size: int, dp: int, expert_dp: Optional[int],
                distributed_optimizer: bool) -> Tuple[int, int]:
    """(padded length, this rank's shard) of the flat buffers, laid out as ``GradBuffer`` does:
    dense parameters reduced over ``dp`` (dp x cp) ranks, experts over ``expert_dp`` when given."""
    from megatron_hydra.parallel.data_parallel import split_layout

    ordered = list(reversed(params))  # the buffer runs in reverse order
    split = expert_dp is not None
    dense = [_Numel(n) for n, expert in ordered if not (split and expert)]
    experts = [_Numel(n) for n, expert in ordered if split and expert]
    sizes = (dp, expert_dp)
    parts = [(members, size, size if distributed_optimizer else 1) for members, size in zip((dense, experts), sizes)]
    layout = split_layout(parts, bucket_size)
    if not distributed_optimizer:
        return layout[-1][2], layout[-1][2]
    return layout[-1][2], sum((end - start) // size for _, start, end, size in layout)


def rank_state(cfg: RunConfig, derived: Derived, pp_rank: int, chunks) -> Tuple[int, int, Tuple[int, int, int, int]]:
    """(trained parameters, frozen parameters (LoRA's base), (weights, grads, main weights,
    optimizer) bytes) of one rank of an MoE run."""

    tc = derived.transformer

    def held(trains: bool) -> List[Tuple[int, bool]]:
        return [p for (_, pre, post), layers in zip(chunks, chunk_ranges(cfg, derived, pp_rank))
                for p in chunk_params(tc, layers, pre, post, derived.tp, derived.ep, derived.etp is not None, trains)]

    params, fixed = held(True), sum(n for n, _ in held(False))  # LoRA: the frozen base holds weights alone
    numel = sum(n for n, _ in params)
    padded, shard = flat_buffer(params, cfg.parallel.grad_bucket_size, derived.dp * derived.cp,
                                expert_dp_size(derived), cfg.optim.distributed_optimizer)
    return numel, fixed, state_bytes(numel, tc.params_dtype, shard, padded, fixed)


def layer_delta_bytes(tc: TransformerConfig, layer: dict) -> float:
    """Bytes an MoE layer keeps beyond a dense layer of ``tc`` (``memory._layer_shape``'s ``layer``)."""

    spec, t, v, h = tc.moe, layer["tp"], layer["value_bytes"], layer["hidden"]
    T = layer["seq"] / layer["cp"] * layer["micro_batch"]
    k, e, r = spec.top_k, spec.num_experts, (1.0 / t if layer["sequence_parallel"] else 1.0)
    w, units = max(v, 4), (4 if tc.activation in GATED_ACTIVATIONS else 2)
    ep_extra = 2 if tc.moe and (layer.get("ep", 1) > 1 or layer.get("whole_experts")) else 0
    # The tokens this rank's dispatch handles, and the expert width it computes: all T tokens
    # gathered over TP and 1/t of each expert; whole experts: its own T/t tokens, whole width.
    Te, fe = (T / t, spec.ffn_hidden_size) if layer.get("whole_experts") else (T, spec.ffn_hidden_size / t)
    moe = w * T * r * h + 3 * w * T * r * e + 4 * (2 * Te * k + 2 * T * r) + 8 * Te * k * (3 + ep_extra)
    moe += v * Te * k * h + units * v * Te * k * fe + (v + w) * Te * k * h
    if spec.shared_ffn_hidden_size:
        moe += v * T * h + units * v * T * spec.shared_ffn_hidden_size / t
    dense = v * T * h * (1.0 if layer["sp_gathered_inputs"] else r) + units * v * T * layer["ffn_hidden"] / t
    return moe - dense


def chunk_activation_deltas(cfg: RunConfig, derived: Derived, pp_rank: int, layer: dict) -> List[Tuple[float, float]]:
    """(stored, replay) bytes each chunk of pipeline rank ``pp_rank`` adds per micro-batch for its
    MoE layers over ``memory._chunk_activations``' dense figures."""
    from megatron_hydra.parallel.recompute import recomputed_chunks

    tc = derived.transformer
    delta = layer_delta_bytes(tc, {**layer, "ep": derived.ep, "whole_experts": derived.etp is not None})
    delta -= frozen.layer_bytes(tc, layer) - frozen.layer_bytes(tc, layer, mlp=False)  # LoRA: no dense MLP here
    out = []
    for layers in chunk_ranges(cfg, derived, pp_rank):
        moe = [i in tc.moe_layers for i in layers]
        if tc.recompute_granularity != "full":
            out.append((sum(moe) * delta, 0.0))
            continue
        stored = replay = 0.0
        for start, end, recomputed in recomputed_chunks(len(layers), "full", tc.recompute_method,
                                                        tc.recompute_num_layers):
            n = sum(moe[start:end]) * delta
            stored, replay = (stored, max(replay, n)) if recomputed else (stored + n, replay)
        out.append((stored, replay))
    return out
