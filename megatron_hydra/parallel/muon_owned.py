"""Muon under the distributed optimizer: every data-parallel rank owns whole matrices.

ZeRO-1 leaves a rank the reduced gradient of 1/dp of every bucket (``parallel.optimizer``), but
Newton-Schulz needs a whole matrix. So each Muon matrix has one *owner* among the ranks of its
bucket's group (dp x cp, or the expert data-parallel group for experts), assigned by
``assign_owners``: largest first to the least loaded rank, from the matrices' sizes alone, so that
the TP peers of an owner own the same matrices (Muon's TP gather of the logical matrix pairs up)
and every pipeline stage splits its own. Momentum lives on the owner only. One step, after the
distributed optimizer's unscaling and clipping of the shards (the norm over shards is the whole
norm):

1. each bucket holding Muon matrices is all-gathered in the gradient buffer (``muon_grad_gather``):
   every rank of the group now has those buckets' reduced, clipped gradients whole;
2. each owner advances its matrices' momentum and computes their orthogonal update;
3. those buckets are zeroed and each owner writes its updates in its matrices' places; a
   reduce-scatter (``muon_update_scatter``) hands every rank the update of its own shard, a sum
   of one update and zeros, so exact;
4. every rank applies the update to its shard pieces of the Muon matrices (their fp32 main pieces
   for a 16-bit model, which Adam leaves alone), elementwise as plain Muon applies it to the whole
   matrix, and the distributed optimizer's parameter all-gather carries them to every rank,
   overlapped with the next forward like every other bucket.

The reduce-scatter stands in for a broadcast from the owner: it costs the same bytes, needs no
broadcast per matrix, and lets the updated matrices ride the parameter gather that already
overlaps the forward. Per step the two collectives count ``2 x`` the bytes of every bucket that
holds a Muon matrix (``collectives.count_comm``'s convention: the whole bucket), beyond ZeRO-1's
own reduce-scatter and all-gather; on the wire a ring sends ``(n-1)/n`` of that (``docs/muon.md``).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.data_parallel import GradBuffer
from megatron_hydra.parallel.muon import Muon


def assign_owners(sizes: List[int], ranks: int) -> List[int]:
    """The owning rank of each matrix of ``sizes`` among ``ranks``: largest first, each to the
    least loaded rank (the lowest on a tie). Pure and deterministic, so that every rank, and the
    memory plan, compute the same assignment."""
    load, owner = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[i], load[rank] = rank, load[rank] + sizes[i]
    return owner


class OwnedMuon:
    """The Muon side of a distributed ``MegatronOptimizer`` (see the module docstring). ``muon``
    does the arithmetic (its ``state`` holds the owned matrices' momentum, keyed by parameter);
    ``params``: every Muon matrix of the buffer; ``pieces``: this rank's shard pieces of them."""

    def __init__(self, muon: Muon, buffer: GradBuffer, params: List[nn.Parameter], pieces: list):
        self.muon, self.buffer, self.pieces = muon, buffer, pieces
        bucket_of = {p: b for b in buffer.buckets for p in b.params}
        ids = {id(p) for p in params}
        self.buckets = [b for b in buffer.buckets if any(id(p) in ids for p in b.params)]
        self.owner: Dict[nn.Parameter, int] = {}
        for group in {id(b.group): b.group for b in self.buckets}.values():
            members = [p for p in params if bucket_of[p].group is group]
            for p, rank in zip(members, assign_owners([p.numel() for p in members], C.group_size(group))):
                self.owner[p] = rank
        self.params = params
        self.mains = [p for p in params if self.owner[p] == C.group_rank(bucket_of[p].group)]  # owned
        self.steps: Dict[nn.Parameter, torch.Tensor] = {}
        self.state = muon.state

    def step_of(self, p: nn.Parameter, step_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``p``'s step count, kept on every rank (the owner's Muon state shares it)."""
        if p not in self.steps:
            self.steps[p] = torch.zeros((), dtype=step_dtype)
        return self.steps[p]

    def init_state(self, p: nn.Parameter, step_dtype: torch.dtype = torch.float32) -> dict:
        """An owned matrix's momentum (like its fp32 gradient) and step count."""
        return self.muon.init_state(p, step_dtype, like=p.main_grad, step=self.step_of(p, step_dtype))

    def piece_state(self, pc, step_dtype: torch.dtype) -> dict:
        """What a shard piece of a Muon matrix has of its state here: the step count."""
        return {"step": self.step_of(pc.param, step_dtype)}

    def set_step(self, p: nn.Parameter, value: torch.Tensor) -> None:
        self.step_of(p, value.dtype).copy_(value)

    def _collective(self, fn, kind: str) -> None:
        buf = self.buffer.buffer
        works = [fn(buf[b.shard_start:b.shard_end], buf[b.start:b.end], b.group, kind)
                 for b in self.buckets if b.size > 1]
        for work in works:
            work.wait()

    @torch.no_grad()
    def step(self, lr: float, weight_decay: float) -> None:
        self._collective(lambda shard, whole, group, kind: C.all_gather_into(whole, shard, group, kind),
                         "muon_grad_gather")
        for p in self.mains:  # each update replaces its own gradient, which nothing reads after
            p.main_grad.copy_(self.muon.direction(p, self.init_state(p), p.main_grad))
        self._zero_all_but_updates()
        self._collective(C.reduce_scatter_into, "muon_update_scatter")
        owned = set(self.mains)
        for p in self.params:
            if p not in owned:
                self.step_of(p).add_(1)
        for pc in self.pieces:  # the grad views now hold this shard's update
            pc.main.mul_(1 - lr * weight_decay).add_(pc.main.grad, alpha=-lr)

    def _zero_all_but_updates(self) -> None:
        """Zero the Muon buckets except this rank's updates, so that the reduce-scatter adds each
        update to zeros only."""
        buf, offsets = self.buffer.buffer, self.buffer.offsets
        kept = sorted((offsets[p], offsets[p] + p.numel()) for p in self.mains)
        for b in self.buckets:
            at = b.start
            for lo, hi in (r for r in kept if b.start <= r[0] < b.end):
                buf[at:lo].zero_()
                at = hi
            buf[at:b.end].zero_()

    def checkpoint_pieces(self, step_dtype: torch.dtype, piece_type) -> list:
        """The owned matrices' momentum, each a whole-tensor piece (checkpoints are layout-free)."""
        out = []
        for p in self.mains:
            state = self.init_state(p, step_dtype)
            momentum = state["momentum_buffer"].view(-1)
            out.append(piece_type(p, 0, p.numel(), state["step"], {"momentum_buffer": momentum}))
        return out

    def state_bytes(self) -> int:
        return self.muon.state_bytes()
