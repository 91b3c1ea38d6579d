"""Mixture of Experts: a router sends each token to k of E expert MLPs (GShard, Switch, Mixtral,
DeepSeek-V3); ``MoELayer`` stands in for ``MLP`` in a block.

Layout. Experts are split over the expert-parallel group (``ParallelState.ep_group``, carved from
data parallelism): EP rank r holds global experts ``[r * E_local, (r + 1) * E_local)``, stacked
in ``experts.fc1`` / ``gate`` / ``fc2`` ([E_local, ...]). Each expert is tensor-parallel like
``MLP`` (fc1 and gate column-, fc2 row-sharded over ``ps.tp_group``). The layer keeps MLP's TP
region convention: it enters the region as a column-parallel layer does (all-gather of the
sequence under SP) and leaves it with one reduction (reduce-scatter under SP), which covers every
expert, because all TP ranks of an EP rank hold the same tokens and route them identically.

Whole experts (``parallel.expert_tensor_parallel_size=1`` with tp > 1, ``ps.experts_split_over_tp``
false): no expert is split over TP; each TP rank routes its own slice of the sequence (the one
it holds under SP; without SP a slice cut from the replicated tokens, whose output is gathered
back) and the EP group spans TP ranks too (``parallel.state.expert_group_ranks``), so small
experts run as whole matmuls and expert parallelism can exceed dp.

Routing is computed on the tokens as they arrive (under SP: this rank's sequence slice, whose
routing is then gathered with the tokens), so that router gradients are exact without double
counting: the combine weights enter the TP region like the tokens (their gradient, partial per TP
rank, is summed there), and the router weight is replicated like a norm (``sequence_parallel``
tag under SP: its grad is summed over TP; otherwise every TP rank computes all of it).

Losses (added to the training loss through ``AuxLossScaler``, not returned):
- load balancing (Switch/GShard): ``aux = coeff * E * sum_e f_e * P_e``, with ``f_e`` the fraction
  of the T*k (token, choice) assignments routed to expert e (before any capacity dropping) and
  ``P_e`` the mean over tokens of the router's probability of e (sigmoid routing: the scores
  normalised per token to sum 1, as DeepSeek-V3's sequence-wise loss does; here over the micro-batch);
- z-loss (ST-MoE): ``coeff * mean_t logsumexp(logits_t)^2``.
Both are over the tokens of the whole micro-batch when its tokens are split over ranks (SP over
TP, CP over cp), as Megatron does: the per-expert counts, probability sums and token count are
all-reduced over ``loss_group`` first, and each rank's loss is its tokens' share of the whole
(the shares add up to the loss; each share's gradient is the whole loss's gradient on those tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.config.transformer_config import MoESpec
from megatron_hydra.models.transformer import GATED, MLP, activation_fn
from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel import expert_dispatch
from megatron_hydra.parallel import mappings as M
from megatron_hydra.parallel.layers import enter_tp_region, replicated
from megatron_hydra.parallel.state import ParallelState

ROUTERS = ("softmax", "sigmoid")
ACTIVATIONS = (*GATED, "relu", "gelu", "gelu_tanh")
# Stacked expert parameter -> its name for one expert (under ``<prefix>.experts.<e>.``).
EXPERT_PARAMETERS = {"fc1": "fc1.weight", "gate": "gate.weight", "fc2": "fc2.weight",
                     "fc1_bias": "fc1.bias", "gate_bias": "gate.bias", "fc2_bias": "fc2.bias"}
GROUPED_MM = True  # torch's grouped GEMM where it runs (CUDA, bf16); else one matmul per expert


def expert_parameter_name(stacked: str, expert: int) -> str:
    """The logical name of global expert ``expert``'s slice of stacked parameter ``stacked``:
    ``layers.3.mlp.experts.fc1`` -> ``layers.3.mlp.experts.5.fc1.weight`` (for expert 5)."""
    prefix, _, own = stacked.rpartition(".")
    return f"{prefix}.{expert}.{EXPERT_PARAMETERS[own]}"


def local_experts(stacked: str, param: torch.Tensor) -> List[Tuple[str, torch.Tensor, Optional[int]]]:
    """Per local expert of stacked parameter ``param`` (named ``stacked``): its logical name, its
    slice (a view: writing it writes the parameter) and the dim of the slice split over TP."""
    dim = param.tp_partition_dim
    inner = None if dim is None else dim - 1
    return [(expert_parameter_name(stacked, param.first_expert + i), param.detach()[i], inner)
            for i in range(param.shape[0])]


def expert_param(shape, tp_dim: Optional[int], num_experts: int, first: int, dtype, device,
                 summed_over_tp: bool = False) -> nn.Parameter:
    """A stacked expert parameter [E_local, ...], tagged for the optimizer, clipping and checkpoints."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    p.tp_partition_dim, p.sequence_parallel = tp_dim, summed_over_tp
    p.expert_parallel, p.num_experts, p.first_expert = True, num_experts, first
    return p


class AuxLossScaler(torch.autograd.Function):
    """Identity on the layer's output; in backward it also gives the router's auxiliary loss the
    gradient ``scale`` (Megatron's aux-loss auto-scaler), so that the loss reaches the router
    without being returned through every module. ``scale`` is the layer's ``aux_loss_scale``,
    which the training loop sets to what the main loss's gradient is multiplied by
    (``loss_scale / num_microbatches``): per layer, not process-wide, so that nothing outlives a run."""

    @staticmethod
    def forward(ctx, output, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss) * ctx.scale, None


class Routing(NamedTuple):
    indices: torch.Tensor  # [T, k] chosen experts, by descending selection score
    weights: torch.Tensor  # [T, k] combine weights
    logits: torch.Tensor  # [T, E]
    probs: torch.Tensor  # [T, E] what the balancing loss averages (each row sums to 1)


class RouterStats(NamedTuple):
    """Detached, over the whole micro-batch (``loss_group``): for logging."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor  # [E] assignments routed to each expert (before dropping)


class Router(nn.Module):
    """Linear scores of each token for every expert (weight [E, h], replicated over TP; logits in
    fp32, or fp64 for an fp64 model) and the top-k choice. ``expert_bias`` (sigmoid routing, or
    any with ``expert_bias_rate > 0``): added to the scores to choose, never to weigh."""

    def __init__(self, spec: MoESpec, hidden: int, dtype: torch.dtype = torch.float32, device=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden, dtype=dtype, device=device))
        replicated(self, sequence_parallel)
        self.biased = spec.router == "sigmoid" or spec.expert_bias_rate > 0
        self.reset_buffers(device)

    def reset_buffers(self, device=None) -> None:
        e = self.spec.num_experts
        if self.biased:
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32, device=device))
        self.register_buffer("routed_since_update", torch.zeros(e, dtype=torch.int64, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> Routing:
        """x: [T, h]."""
        spec = self.spec
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        scores = logits.softmax(-1) if spec.router == "softmax" else logits.sigmoid()
        select = scores.detach() + self.expert_bias.to(dtype) if self.biased else scores.detach()
        indices = select.topk(spec.top_k, dim=-1).indices
        weights = scores.gather(-1, indices)
        if spec.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        probs = scores if spec.router == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(indices, weights, logits, probs)

    @torch.no_grad()
    def count(self, indices: torch.Tensor) -> None:
        """Add a forward's choices to the load the next bias update balances."""
        self.routed_since_update += expert_dispatch.expert_counts(indices, self.spec.num_experts)

    @torch.no_grad()
    def update_bias(self, group=None) -> None:
        """``bias_e += rate * sign(mean_load - load_e)`` (DeepSeek-V3), from the assignments counted
        since the last update, summed over ``group``; then the count restarts."""
        load = self.routed_since_update.clone()
        C.all_reduce(load, group)
        # mean - load_e = (total - E * load_e) / E: the sign in exact integers.
        self.expert_bias += self.spec.expert_bias_rate * torch.sign(load.sum() - self.spec.num_experts * load).float()
        self.routed_since_update.zero_()


def router_losses(routing: Routing, spec: MoESpec, group=None) -> Tuple[Optional[torch.Tensor], RouterStats]:
    """This rank's share of ``aux + z`` (None when both coefficients are 0) and the detached
    micro-batch values. ``group``: the ranks the micro-batch's tokens are split over (None: all
    here); the counts, probability sums, squared log-sum-exps and token counts are all-reduced
    over it, so every share is formed with the whole micro-batch's f_e and T."""
    e, k = spec.num_experts, spec.top_k
    lse = torch.logsumexp(routing.logits, -1)
    local = torch.cat([expert_dispatch.expert_counts(routing.indices, e).double(),
                       routing.probs.detach().sum(0).double(), lse.detach().double().pow(2).sum().view(1),
                       lse.new_full((1,), lse.shape[0], dtype=torch.float64)])
    total = C.all_reduce(local, group)
    counts, prob_sums, z_sum, tokens = total[:e], total[e:2 * e], total[2 * e], total[2 * e + 1]
    f = counts / (tokens * k)
    stats = RouterStats(spec.aux_loss_coeff * e * (f * prob_sums / tokens).sum(), spec.z_loss_coeff * z_sum / tokens,
                        counts.to(torch.int64))
    parts = []
    if spec.aux_loss_coeff:
        parts.append(spec.aux_loss_coeff * e * (f.to(lse.dtype) * routing.probs.sum(0)).sum() / tokens.to(lse.dtype))
    if spec.z_loss_coeff:
        parts.append(spec.z_loss_coeff * lse.pow(2).sum() / tokens.to(lse.dtype))
    return (sum(parts) if parts else None), stats


def _grouped(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: CUDA bf16 with 16-byte aligned rows
    (torch 2.13's CPU kernel takes fp32/bf16 forward but fails in backward)."""
    return (GROUPED_MM and hasattr(F, "grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and all(w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0 for w in weights))


class Experts(nn.Module):
    """This EP rank's routed experts, stacked: ``fc1`` and ``gate`` [E_local, ffn / tp, h] (column
    shards), ``fc2`` [E_local, h, ffn / tp] (row shards), biases [E_local, ...]. fc2's bias is
    replicated over TP and added on TP rank 0 only (before the layer's TP reduction), so its grad
    is complete there and zero elsewhere: it is tagged to be summed over TP."""

    def __init__(self, num_experts: int, first: int, num_local: int, hidden: int, ffn: int, activation: str,
                 tp_group=None, bias: bool = False, dtype: torch.dtype = torch.float32, device=None,
                 split_over_tp: bool = True):
        super().__init__()
        if not split_over_tp:  # whole experts (expert_tensor_parallel_size=1): nothing tagged as TP-sharded
            tp_group = None
        tp = C.group_size(tp_group)
        if ffn % tp:
            raise ValueError(f"expert ffn_hidden_size={ffn} is not divisible by the tensor-parallel size {tp}")
        f = ffn // tp
        self.activation, self.tp_rank = activation, C.group_rank(tp_group)
        gated = activation in GATED

        def param(shape, dim, summed=False):
            return expert_param(shape, dim if split_over_tp else None, num_experts, first, dtype, device, summed)

        self.fc1 = param((num_local, f, hidden), 1)
        self.gate = param((num_local, f, hidden), 1) if gated else None
        self.fc2 = param((num_local, hidden, f), 2)
        self.fc1_bias = param((num_local, f), 1) if bias else None
        self.gate_bias = param((num_local, f), 1) if bias and gated else None
        self.fc2_bias = param((num_local, hidden), None, tp > 1) if bias else None

    def forward(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """x: [sum(counts), h], local expert i's ``counts[i]`` rows after expert i-1's."""
        act = activation_fn(self.activation)
        fc2_bias = self.fc2_bias if self.fc2_bias is None or self.tp_rank == 0 else self.fc2_bias * 0
        if _grouped(x, self.fc1, self.fc2):
            return self._grouped_forward(x, counts, act, fc2_bias)
        outs = []
        for i, rows in enumerate(x.split(counts)):
            h = F.linear(rows, self.fc1[i], None if self.fc1_bias is None else self.fc1_bias[i])
            if self.gate is not None:
                h = act(F.linear(rows, self.gate[i], None if self.gate_bias is None else self.gate_bias[i])) * h
            else:
                h = act(h)
            outs.append(F.linear(h, self.fc2[i], None if fc2_bias is None else fc2_bias[i]))
        return torch.cat(outs)

    def _grouped_forward(self, x, counts, act, fc2_bias):
        sizes = torch.tensor(counts, device=x.device)
        offs = torch.cumsum(sizes, 0).to(torch.int32)

        def linear(inp, w, b):
            y = F.grouped_mm(inp, w.transpose(-2, -1), offs=offs)
            return y if b is None else y + b.repeat_interleave(sizes, dim=0, output_size=inp.shape[0])

        h = linear(x, self.fc1, self.fc1_bias)
        h = act(linear(x, self.gate, self.gate_bias)) * h if self.gate is not None else act(h)
        return linear(h, self.fc2, fc2_bias)


@dataclass(frozen=True)
class _SharedFFN:
    """The fields of ``TransformerConfig`` that ``MLP`` reads: the shared expert is an ``MLP``."""

    hidden_size: int
    ffn_hidden_size: int
    activation: str
    add_bias_linear: bool
    sequence_parallel: bool
    params_dtype: torch.dtype
    tp_comm_overlap: bool = False  # the shared expert keeps the plain collectives, as the experts do


def default_loss_group(ps: ParallelState, sequence_parallel: bool):
    """The ranks a micro-batch's tokens are split over at an MLP: TP under SP, or cp."""
    if ps.cp_size > 1 and sequence_parallel and ps.tp_size > 1:
        raise ValueError("context and sequence parallelism split a micro-batch over cp x tp ranks: pass "
                         "MoELayer(loss_group=...) that group")
    if ps.cp_size > 1:
        return ps.cp_group
    return ps.tp_group if sequence_parallel else None


class MoELayer(nn.Module):
    """Drop-in for ``MLP``: [b, s, h] in and out (s: this rank's slice under sequence parallelism).

    After each forward the module keeps, detached, ``aux_loss``, ``z_loss`` (the micro-batch's,
    coefficients included), ``tokens_per_expert`` ([E], the micro-batch's routed assignments) and
    ``dropped`` and ``assigned`` (the (token, choice) assignments this rank dropped by capacity,
    and all it routed). ``loss_group``: see
    ``router_losses``; "auto" is ``default_loss_group``."""

    def __init__(self, spec: MoESpec, hidden: int, activation: str, ps: ParallelState,
                 params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False, device=None,
                 bias: bool = False, loss_group="auto"):
        super().__init__()
        e, ep = spec.num_experts, ps.ep
        if e % ep:
            raise ValueError(f"num_experts={e} is not divisible by the expert-parallel size {ep}")
        if not 1 <= spec.top_k <= e:
            raise ValueError(f"top_k={spec.top_k} must be between 1 and num_experts={e}")
        if spec.router not in ROUTERS or activation not in ACTIVATIONS:
            raise ValueError(f"router={spec.router!r} / activation={activation!r}: choose from {ROUTERS} / "
                             f"{ACTIVATIONS}")
        self.spec, self.sequence_parallel = spec, sequence_parallel
        self.tp_group, self.ep_group = ps.tp_group, ps.ep_group
        self.loss_group = default_loss_group(ps, sequence_parallel) if loss_group == "auto" else loss_group
        self.router = Router(spec, hidden, params_dtype, device, sequence_parallel)
        local = e // ep
        self.experts_split_over_tp = ps.experts_split_over_tp
        self.experts = Experts(e, ps.ep_rank * local, local, hidden, spec.ffn_hidden_size, activation, ps.tp_group,
                               bias, params_dtype, device, split_over_tp=ps.experts_split_over_tp)
        self.shared = None
        if spec.shared_ffn_hidden_size:
            shape = _SharedFFN(hidden, spec.shared_ffn_hidden_size, activation, bias, sequence_parallel, params_dtype)
            self.shared = MLP(shape, ps, device)
        self.aux_loss = self.z_loss = self.tokens_per_expert = None
        self.dropped = self.assigned = 0
        # d(training loss)/d(router losses) in the next backward (AuxLossScaler; set by the training step).
        self.aux_loss_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        k, sp, tp_group = self.spec.top_k, self.sequence_parallel, self.tp_group
        routing = self.router(x.reshape(-1, h))
        loss, (self.aux_loss, self.z_loss, self.tokens_per_expert) = router_losses(routing, self.spec, self.loss_group)
        if self.training and self.spec.expert_bias_rate:
            self.router.count(routing.indices)
        weights, indices = routing.weights.view(b, s, k), routing.indices.view(b, s, k)
        if self.experts_split_over_tp:  # every TP rank of this EP rank now holds the same tokens and routing
            tokens, weights = enter_tp_region(x, tp_group, sp), enter_tp_region(weights, tp_group, sp)
            if sp:
                indices = C.all_gather(indices, M.SEQ_DIM, tp_group)
        else:  # whole experts: each TP rank routes its own slice of the sequence (under SP, the one it has)
            tokens = x
            if not sp:
                tokens, weights = M.split_sequence(x, tp_group), M.split_sequence(weights, tp_group)
                indices = C.split(indices, M.SEQ_DIM, tp_group)
        y = self._routed(tokens.reshape(-1, h), indices.reshape(-1, k), weights.reshape(-1, k))
        y = y.to(x.dtype).view(tokens.shape)
        if self.experts_split_over_tp:
            out = M.reduce_scatter_to_sp(y, tp_group) if sp else M.reduce_from_tp(y, tp_group)
        else:
            out = y if sp else M.gather_sequence(y, tp_group)
        if self.shared is not None:
            out = out + self.shared(x)
        if loss is not None and torch.is_grad_enabled():
            out = AuxLossScaler.apply(out, loss, self.aux_loss_scale)
        return out

    def _routed(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_j weights[t, j] * expert_{indices[t, j]}(x[t]) for this EP rank's tokens (partial over TP)."""
        spec, group = self.spec, self.ep_group
        cap = None
        if spec.capacity_factor is not None:
            cap = expert_dispatch.capacity(x.shape[0], spec.top_k, spec.num_experts, spec.capacity_factor)
        plan = expert_dispatch.plan(indices, weights, spec.num_experts, group, cap)
        self.dropped, self.assigned = plan.dropped, indices.numel()
        y = self.experts(expert_dispatch.dispatch(x, plan, group), plan.expert_counts)
        return expert_dispatch.combine(y, plan, weights, x.shape[0], group)

    def update_expert_bias(self, group=None) -> None:
        """Call after each optimizer step when ``expert_bias_rate > 0``: moves the selection bias
        by the load counted since the last call (training forwards), summed over ``group``: the
        ranks that hold this layer (dp x cp x tp of its stage, ``ps.group("amax")``), so that all
        of them agree. Loads counted several times alike (each TP rank counts all tokens without
        SP; a layer under full recomputation counts each micro-batch twice) are all scaled by one
        factor, which leaves ``sign(mean - load)`` unchanged."""
        if self.spec.expert_bias_rate:
            self.router.update_bias(group)


def build_moe(cfg, ps: ParallelState, device=None) -> MoELayer:
    """The local backend's Mixture-of-Experts MLP for a block of ``cfg`` (a ``TransformerConfig``
    with ``moe`` set; ``models.backends``)."""
    return MoELayer(cfg.moe, cfg.hidden_size, cfg.activation, ps, cfg.params_dtype, cfg.sequence_parallel, device,
                    bias=cfg.add_bias_linear)
