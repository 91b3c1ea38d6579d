"""Muon for the hidden 2-D weights: momentum, then an orthogonalised update (Keller Jordan, 2024).

For each matrix ``W`` with gradient ``G`` and momentum buffer ``B`` (zero at the start)::

    B <- mu * B + G
    U <- G + mu * B   (Nesterov)   or   B   (plain)
    O <- NS5(U)                     # ~ the orthogonal factor of U's polar decomposition
    W <- W * (1 - lr * wd) - lr * 0.2 * sqrt(max(rows, cols)) * O

``NS5`` is the quintic Newton-Schulz iteration with the published coefficients (3.4445, -4.7750,
2.0315) on ``U`` divided by its Frobenius norm, on the transpose when ``U`` has more rows than
columns (the iteration then multiplies the smaller Gram matrix). The factor ``0.2 * sqrt(max)``
(Moonlight, Liu et al. 2025) gives the update about the RMS of an AdamW update, so Muon can reuse
AdamW's learning rate and weight decay. Everything else (embeddings, the output layer, norms,
biases, routers) is left to AdamW (``parallel.optimizer``).

Under tensor parallelism the orthogonalisation is of the *logical* matrix: the momentum step is
elementwise on the local shard, then ``U``'s shards are all-gathered over the TP group, every TP
rank runs NS5 on the whole matrix (the same arithmetic on the same data, so the ranks agree) and
keeps its own slice. Per step a TP rank receives ``(tp - 1) / tp`` of every TP-sharded hidden matrix
it holds, in NS5's dtype (bf16 on an accelerator, 2 bytes an element); the TP group computes each
NS5 ``tp`` times over, the price of a gather with no second collective to scatter. NS5 is
equivariant under permuting rows or columns, so the shards' order (a fused QKV's per-group rows,
for instance) needs no reordering. An MoE layer's stacked expert tensor is one matrix per expert.
``split_qkv`` orthogonalises a fused QKV weight's q, k and v rows of each query group apart.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import nn

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.data_parallel import is_expert
from megatron_hydra.parallel.state import ParallelState

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_KEYS = ("momentum_buffer",)
HIDDEN_MODULE = re.compile(r"(^|\.)(attention|cross_attention|mlp)\.")


@dataclass
class MuonSettings:
    """``optim.muon_*``: the Muon side's hyperparameters (lr and weight decay come per step/group)."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    split_qkv: bool = False


def newton_schulz(u: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """NS5 of the 2-D ``u`` computed in ``dtype`` (bf16 on an accelerator, the parameter's dtype on
    CPU, where bf16 matmuls are slow and buy nothing), returned in ``u``'s dtype."""
    a, b, c = NS_COEFFICIENTS
    x = u.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(u.dtype)


def scaled_orthogonal(u: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """NS5 of ``u`` times Moonlight's ``0.2 * sqrt(max(rows, cols))``."""
    return newton_schulz(u, steps, dtype) * (0.2 * math.sqrt(max(u.shape)))


def qkv_blocks(rows: int, heads_per_group: int, kv_channels: int) -> List[int]:
    """Row counts of a fused QKV weight's blocks in order: per query group, its q heads, then k, then v."""
    per_group = (heads_per_group + 2) * kv_channels
    return [heads_per_group * kv_channels, kv_channels, kv_channels] * (rows // per_group)


def is_muon_param(name: str, p: nn.Parameter) -> bool:
    """A hidden matrix of a transformer block: a 2-D weight (per expert for stacked experts) of an
    attention or MLP module, whatever the stack is called (``layers.``, T5's ``encoder.``), except
    a router (whose few rows score experts, as an output layer scores tokens)."""
    logical = p.ndim - 1 if is_expert(p) else p.ndim
    return logical == 2 and HIDDEN_MODULE.search(name) is not None and ".router." not in name


def qkv_shapes(model: nn.Module) -> Dict[nn.Parameter, tuple]:
    """``(heads_per_group, kv_channels)`` of each fused QKV weight of ``model``, for ``split_qkv``."""
    out = {}
    for module in model.modules():
        qkv = getattr(module, "qkv", None)
        if qkv is not None and hasattr(module, "heads_per_group") and hasattr(qkv, "weight"):
            out[qkv.weight] = (module.heads_per_group, module.cfg.kv_channels)
    return out


class Muon:
    """The Muon side of ``MegatronOptimizer``: steps ``mains`` (the tensors updated, whose grads are
    the reduced gradients) of the model parameters ``params`` in place. ``state`` maps each main to
    its ``momentum_buffer`` and ``step`` count, as torch's optimizers keep theirs."""

    def __init__(self, params: List[nn.Parameter], mains: List[nn.Parameter], ps: ParallelState,
                 settings: MuonSettings, qkv: Dict[nn.Parameter, tuple], ns_dtype: Optional[torch.dtype] = None):
        self.params, self.mains, self.ps, self.settings, self.qkv = params, mains, ps, settings, qkv
        self.ns_dtype = ns_dtype
        self.state: Dict[nn.Parameter, dict] = {}

    def init_state(self, main: torch.Tensor, step_dtype: torch.dtype = torch.float32,
                   like: Optional[torch.Tensor] = None, step: Optional[torch.Tensor] = None) -> dict:
        """``main``'s state, created (zero) when missing: a momentum buffer like ``like`` (default
        ``main``) and the step count ``step`` (default a new one)."""
        state = self.state.get(main)
        if state is None:
            state = self.state[main] = {"step": torch.zeros((), dtype=step_dtype) if step is None else step,
                                        "momentum_buffer": torch.zeros_like(main if like is None else like)}
        return state

    def _gathered(self, p: nn.Parameter) -> bool:
        dim = getattr(p, "tp_partition_dim", None)
        if dim is None or C.group_size(self.ps.tp_group) == 1:
            return False
        return self.ps.experts_split_over_tp if is_expert(p) else True

    def _orthogonal(self, p: nn.Parameter, u: torch.Tensor) -> torch.Tensor:
        """The scaled NS5 update of one matrix ``u`` (a TP shard of it when ``p`` is sharded)."""
        dtype, out_dtype = self.ns_dtype or u.dtype, u.dtype
        u = u.to(dtype)  # gathered in the dtype NS5 runs in: bf16 halves an accelerator's bytes
        gathered = self._gathered(p)
        if gathered:
            dim = p.tp_partition_dim - (1 if is_expert(p) else 0)
            tp, rank = C.group_size(self.ps.tp_group), C.group_rank(self.ps.tp_group)
            moved = u.movedim(dim, 0).contiguous()
            full = torch.empty((tp * moved.shape[0],) + moved.shape[1:], dtype=u.dtype, device=u.device)
            C.all_gather_into(full, moved, self.ps.tp_group, "muon_tp_gather").wait()
            u = full.movedim(0, dim)
        steps = self.settings.ns_steps
        if p in self.qkv and self.settings.split_qkv:
            sizes = qkv_blocks(u.shape[0], *self.qkv[p])
            o = torch.cat([scaled_orthogonal(block, steps, dtype) for block in u.split(sizes, 0)], 0)
        else:
            o = scaled_orthogonal(u, steps, dtype)
        return (o.chunk(tp, dim)[rank] if gathered else o).to(out_dtype)

    @torch.no_grad()
    def direction(self, p: nn.Parameter, state: dict, grad: torch.Tensor) -> torch.Tensor:
        """Advance ``p``'s momentum ``state`` by ``grad`` and return the scaled orthogonal update."""
        mu = self.settings.momentum
        state["step"] += 1
        buf = state["momentum_buffer"]
        buf.mul_(mu).add_(grad)
        u = grad.add(buf, alpha=mu) if self.settings.nesterov else buf
        if is_expert(p):
            return torch.stack([self._orthogonal(p, u[e]) for e in range(u.shape[0])])
        return self._orthogonal(p, u)

    @torch.no_grad()
    def step(self, lr: float, weight_decay: float) -> None:
        for p, main in zip(self.params, self.mains):
            update = self.direction(p, self.init_state(main), main.grad)
            main.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)

    def state_bytes(self) -> int:
        return sum(s["momentum_buffer"].numel() * s["momentum_buffer"].element_size() for s in self.state.values())
