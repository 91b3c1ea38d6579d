"""The optimizer step: AdamW over "main" parameters, optionally sharded over data-parallel ranks.

What Adam updates (the *main* parameters) depends on the run, the step around it does not:

- fp32/fp64 model: the model's own parameters; their grads already are the buffer's views.
- bf16/fp16 model: an fp32 copy of each parameter, whose grad is the fp32 buffer view
  (``p.main_grad``); after the step the copy is rounded into the model's 16-bit parameter.
- distributed optimizer (ZeRO-1, as Megatron's): data-parallel rank r owns the r-th 1/dp of every
  bucket of the flat gradient buffer (``parallel.data_parallel``). Its main parameters are the
  *pieces* of the model parameters that fall in that range: views into a flat parameter buffer
  that the model parameters also view (fp32), or fp32 copies of them (16-bit). Adam state exists
  for those pieces only: 1/dp of the plain optimizer's. The grads arrive reduce-scattered (during
  backward, bucket by bucket); after the step each bucket's updated shard is all-gathered into the
  parameter buffer asynchronously, in the order the next forward reads the buckets, and a forward
  pre-hook on each module waits for the buckets of its own parameters, so the gather overlaps the
  next forward (``parallel.overlap_param_gather``; false: the step waits for every gather). Expert parameters (expert
  parallelism) have buckets of their own, reduced over the expert data-parallel group (the ranks
  holding the same experts): their shards, Adam state and all-gathers are over that group, so
  rank r of it owns the r-th 1/size of each expert bucket.
- fully sharded data parallelism (``parallel.data_parallel=fsdp``, no gradient buffer): FSDP keeps
  each parameter as this rank's rows of it (``parallel.fsdp``), in fp32 for 16-bit models, and
  reduce-scatters the grads into the same rows. The pieces are those rows: plain tensors sharing
  the sharded parameters' storage, so Adam updates them in place and FSDP gathers the result at
  the next forward. Adam state covers them only, as with the distributed optimizer.

One step: sequence-parallel grads summed over TP -> (fp16) unscale by the loss scale and agree over
every rank whether any gradient overflowed, skipping the step everywhere if so -> clip by the
global norm -> AdamW -> write the main parameters back into the model. Elementwise AdamW on a
piece is AdamW on the whole tensor, so the sharded step equals the plain one.

With ``muon`` (``optim=muon``) the hidden matrices of the transformer blocks are stepped by Muon
(``parallel.muon``) instead, on the same main parameters after the same unscaling and clipping;
AdamW keeps the rest at its own learning rate. Muon needs each matrix whole (up to TP, which it
gathers): with the distributed optimizer each data-parallel rank owns whole matrices and the
updates travel back through the parameter gather (``parallel.muon_owned``); FSDP is refused
(``config.optim``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.data_parallel import GradBuffer, allreduce_sequence_parallel_grads, is_expert, same_memory
from megatron_hydra.parallel.fsdp import local_rows, local_shard
from megatron_hydra.parallel.grad_clip import clip_grads, counted
from megatron_hydra.parallel.muon import MUON_KEYS, Muon, MuonSettings, is_muon_param, qkv_shapes
from megatron_hydra.parallel.muon_owned import OwnedMuon
from megatron_hydra.parallel.state import ParallelState

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
# ``optim.impl``: the kernel that steps the main parameters. ``fused`` and ``foreach`` are
# torch.optim.AdamW's two multi-tensor implementations, ``apex`` is NVIDIA apex's FusedAdam in
# AdamW mode. ``auto`` is ``fused`` on CUDA and ``CPU_IMPL`` on CPU, the faster of the two there
# for our step (measured by benchmarks/adamw_impl.py, whose docstring has the numbers).
ADAMW_IMPLS = ("auto", "fused", "foreach", "apex")
CPU_IMPL = "fused"


def resolve_impl(impl: str, device: torch.device) -> str:
    """The concrete implementation ``impl`` stands for on ``device``."""
    if impl != "auto":
        return impl
    return "fused" if device.type == "cuda" else CPU_IMPL


def build_adamw(groups: List[dict], impl: str, *, lr: float, betas, eps: float) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay, per group) over ``groups`` with the concrete ``impl``."""
    if impl == "apex":
        from apex.optimizers import FusedAdam  # present in NVIDIA's NGC images; the launcher checks first

        return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=impl == "fused", foreach=impl == "foreach")


@dataclass
class StatePiece:
    """Elements ``[lo, hi)`` of ``param`` flattened, as a checkpoint sees this rank's optimizer
    state for them: the step count and flat views of the state tensors. ``param`` is the tensor
    this rank holds (its TP shard). For an expert parameter (``data_parallel.is_expert``) that is
    this rank's experts stacked, ``[E_local, ...]``: the range may run over several of them
    (``expert_ranges`` splits it)."""

    param: nn.Parameter
    lo: int
    hi: int
    step: torch.Tensor
    tensors: Dict[str, torch.Tensor]


def expert_ranges(param: nn.Parameter, lo: int, hi: int, ep_rank: int) -> List[tuple]:
    """Elements ``[lo, hi)`` of the flattened stacked expert parameter ``param`` (``[E_local,
    ...]``, this rank's experts ``ep_rank * E_local`` to ``(ep_rank + 1) * E_local - 1``), split by
    expert: ``(expert, start, end)`` with the global expert index and the flat range of that
    expert's own tensor ``param[e - ep_rank * E_local]``; in order, together they are ``[lo, hi)``."""
    local = param.shape[0]
    per = param.numel() // local
    out, at = [], lo
    while at < hi:
        e = at // per
        end = min(hi, (e + 1) * per)
        out.append((ep_rank * local + e, at - e * per, end - e * per))
        at = end
    return out


def logical_ndim(p: nn.Parameter) -> int:
    """Dimensions of one logical tensor of ``p``: an expert parameter stacks its experts' along
    dim 0 (weight decay follows this: an expert's bias is not decayed, its matrices are)."""
    return p.ndim - 1 if is_expert(p) else p.ndim


@dataclass
class Piece:
    """The part ``[lo, hi)`` of the flattened ``param`` that this rank's Adam updates as ``main``."""

    param: nn.Parameter
    lo: int
    hi: int
    main: nn.Parameter
    offset: int  # where param starts in the flat buffers


class MegatronOptimizer(torch.optim.Optimizer):
    """AdamW with Megatron's mixed-precision and ZeRO-1 bookkeeping (see the module docstring).

    A complete ``torch.optim.Optimizer`` (its base is initialised: hooks, profiling and Lightning's
    wrappers work as on any optimizer) whose ``param_groups`` and ``state`` are the inner AdamW's
    own objects, so a change through either is seen by both; gradients are zeroed by the step
    (in the buffer, or on the FSDP parameters), not here. ``grad_buffer=None``: ``model`` is
    fully sharded by FSDP (``parallel.fsdp``). ``muon``: Muon for the hidden matrices (the module
    docstring), with AdamW's learning rate ``adam_lr`` times the scheduled one over ``lr``."""

    def __init__(self, model: nn.Module, grad_buffer: Optional[GradBuffer], ps: ParallelState, *, lr: float, betas,
                 eps: float, weight_decay: float, clip_grad: float, scaler=None, impl: str = "auto",
                 muon: Optional[MuonSettings] = None, adam_lr: Optional[float] = None,
                 overlap_param_gather: bool = True):
        self.ps, self.buffer, self.scaler, self.clip_grad = ps, grad_buffer, scaler, clip_grad
        self.overlap_param_gather = overlap_param_gather
        self.fsdp = grad_buffer is None
        if not self.fsdp and grad_buffer.expert_group is None and C.group_size(ps.ep_group) > 1 and any(
                is_expert(p) for p in grad_buffer.params):
            raise ValueError("expert parameters under expert parallelism need a GradBuffer with expert_dp_group "
                             "(ParallelState.expert_dp_group): their gradients reduce over it, not over dp x cp")
        self.distributed = not self.fsdp and grad_buffer.distributed
        self.separate = not self.fsdp and grad_buffer.separate  # 16-bit model: fp32 main copies
        self.last_grad_norm: Optional[torch.Tensor] = None
        self._gathers: Dict[int, object] = {}
        self._hooks: list = []
        if muon is not None and self.fsdp:
            raise ValueError("Muon steps whole matrices: it runs without FSDP")
        if self.fsdp:
            self.pieces = self._fsdp_pieces(model)
        else:
            self.pieces = self._sharded_pieces(model) if self.distributed else self._whole_pieces()
        names = {p: n for n, p in model.named_parameters()}
        muon_pieces = ([pc for pc in self.pieces if is_muon_param(names.get(pc.param, ""), pc.param)]
                       if muon is not None else [])
        self._muon_of = {id(pc) for pc in muon_pieces}  # the pieces Muon steps
        adam = [pc for pc in self.pieces if id(pc) not in self._muon_of]
        decay = [pc.main for pc in adam if logical_ndim(pc.param) >= 2]
        no_decay = [pc.main for pc in adam if logical_ndim(pc.param) < 2]
        self.impl = resolve_impl(impl, self.pieces[0].main.device)
        self.inner = build_adamw([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], self.impl, lr=lr, betas=betas, eps=eps)
        self.adam_lr_ratio = 1.0 if adam_lr is None else adam_lr / lr
        groups = self.inner.param_groups
        self.muon = None
        if muon is not None:
            device = self.pieces[0].main.device
            ns_dtype = None if device.type == "cpu" else torch.bfloat16
            if self.distributed:
                owned = [p for p in self.buffer.params if is_muon_param(names.get(p, ""), p)]
                self.muon = OwnedMuon(Muon([], [], ps, muon, qkv_shapes(model), ns_dtype), self.buffer, owned,
                                      muon_pieces)
            else:
                self.muon = Muon([pc.param for pc in muon_pieces], [pc.main for pc in muon_pieces], ps, muon,
                                 qkv_shapes(model), ns_dtype=ns_dtype)
            groups = groups + [{"params": [pc.main for pc in muon_pieces], "lr": lr, "weight_decay": weight_decay,
                                "muon": True}]
        super().__init__(groups, self.inner.defaults)
        self.param_groups, self.state = groups, self.inner.state

    # Construction ----------------------------------------------------------------------------
    def _whole_pieces(self) -> List[Piece]:
        pieces = []
        for p in self.buffer.params:
            if self.separate:
                main = nn.Parameter(p.detach().float().clone())
                main.grad = p.main_grad
            else:
                main = p
            pieces.append(Piece(p, 0, p.numel(), main, self.buffer.offsets[p]))
        return pieces

    def _fsdp_pieces(self, model: nn.Module) -> List[Piece]:
        """This rank's rows of every FSDP-sharded parameter, as flat ranges of the TP-local tensor."""
        pieces = []
        for p in model.parameters():
            if not p.requires_grad:
                continue
            rows, r0 = local_rows(p)
            per_row = p.numel() // p.shape[0] if p.ndim and p.shape[0] else p.numel()
            pieces.append(Piece(p, r0 * per_row, r0 * per_row + rows.numel(), nn.Parameter(rows), 0))
        return pieces

    def _attach_fsdp_grads(self) -> None:
        """Point each piece at its parameter's current rows and reduced gradient (FSDP assigns a
        new gradient every step; a parameter that got none steps with a zero one, as a buffered
        gradient would)."""
        for pc in self.pieces:
            rows = local_shard(pc.param)
            if not same_memory(pc.main, rows):
                pc.main.data = rows
            grad = pc.param.grad
            pc.main.grad = local_shard(grad) if grad is not None else torch.zeros_like(rows)

    def _sharded_pieces(self, model: nn.Module) -> List[Piece]:
        buf = self.buffer
        first = buf.params[0]
        # The model's parameters become views of one flat buffer laid out like the grads, so a
        # bucket's all-gather lands directly in them.
        self.param_buffer = torch.zeros(buf.buffer.numel(), dtype=first.dtype, device=first.device)
        for p, off in buf.offsets.items():
            view = self.param_buffer[off:off + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
        shard_total = sum(b.shard_end - b.shard_start for b in buf.buckets)
        self.main_buffer = (torch.zeros(shard_total, dtype=torch.float32, device=first.device)
                            if self.separate else None)
        pieces, main_at = [], 0
        self._main_shards = []  # (bucket, offset in main_buffer) for the write-back
        for bucket in buf.buckets:
            self._main_shards.append((bucket, main_at))
            for p in bucket.params:
                off = buf.offsets[p]
                lo, hi = max(off, bucket.shard_start), min(off + p.numel(), bucket.shard_end)
                if lo >= hi:
                    continue
                if self.separate:
                    at = main_at + lo - bucket.shard_start
                    source = self.main_buffer[at:at + hi - lo]
                    source.copy_(self.param_buffer[lo:hi])
                else:
                    source = self.param_buffer[lo:hi]
                main = nn.Parameter(source)  # shares the storage: Adam updates the buffer in place
                main.grad = buf.buffer[lo:hi]
                pieces.append(Piece(p, lo - off, hi - off, main, off))
            main_at += bucket.shard_end - bucket.shard_start
        self._wait_for = {}  # module -> buckets it must wait for before its forward
        bucket_of = {p: i for i, b in enumerate(buf.buckets) for p in b.params}
        for module in model.modules():
            own = [bucket_of[p] for p in module.parameters(recurse=False) if p in bucket_of]
            if own:
                self._wait_for[module] = sorted(set(own))
                self._hooks.append(module.register_forward_pre_hook(self._before_forward))
        # The tied embedding is read by the output layer without its module's forward: whoever
        # owns the whole stage waits for it too.
        tied = sorted({bucket_of[p] for p in buf.params if getattr(p, "shared_embedding", False)})
        for chunk in (model if isinstance(model, nn.ModuleList) else [model]):
            if tied:
                self._wait_for[chunk] = sorted(set(self._wait_for.get(chunk, [])) | set(tied))
                if not any(True for _ in chunk.parameters(recurse=False)):
                    self._hooks.append(chunk.register_forward_pre_hook(self._before_forward))
        return pieces

    # The step --------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Grads live in the gradient buffer (or on FSDP's parameters); the step zeroes them (``training.step``)."""

    def _unscale_and_check(self, grads: List[torch.Tensor]) -> bool:
        """fp16: divide the loss scale out of ``grads`` and say whether any rank's gradients hold
        NaN or inf. One fused pass checks and unscales every tensor (no per-tensor host read); the
        flag is reduced over the model (tp x pp) and data-parallel groups (so every rank sees every
        rank's, expert gradients included: model x dp x cp spans the ep groups, whole experts' too), then read on the host
        once: skipping the step and the scaler's bookkeeping happen on the host (as in Megatron),
        so an fp16 step waits for its gradients here, the one host sync of an fp16 step."""
        device = grads[0].device
        found = torch.zeros((), dtype=torch.float32, device=device)
        inv = 1.0 / self.scaler.scale
        if inv <= 1.0:
            # The fused op checks its input; multiplying by inv in (0, 1] never turns a finite
            # value into inf, so checking before unscaling finds what checking after would.
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((), inv, device=device))
        else:  # a loss scale below 1 (precision.min_loss_scale < 1): unscale first, then check
            torch._foreach_mul_(grads, inv)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones((), device=device))
        C.all_reduce(found, self.ps.group("model"), op=dist.ReduceOp.MAX)
        C.all_reduce(found, self.ps.dp_cp_group, op=dist.ReduceOp.MAX)
        return bool(found.item())

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        self.finish_param_gather()
        if self.fsdp:
            self._attach_fsdp_grads()
        params = [pc.param for pc in self.pieces]
        grads = [pc.main.grad for pc in self.pieces]
        allreduce_sequence_parallel_grads(params, self.ps.tp_group, grads)
        if self.scaler is not None:
            found_inf = self._unscale_and_check(grads)
            self.scaler.update(found_inf)
            if found_inf:  # on the grads' device, as a computed norm would be
                self.last_grad_norm = torch.full((), float("nan"), device=grads[0].device)
                self._release_fsdp_grads()
                return None
        sharded = (self.fsdp or self.distributed) and C.group_size(self.ps.dp_cp_group) > 1
        self.last_grad_norm = clip_grads(grads, [counted(p, self.ps) for p in params], self.clip_grad, self.ps,
                                         sharded_over_dp=sharded, experts=[is_expert(p) for p in params])
        self._step_inner()
        self._write_back()
        self._release_fsdp_grads()
        return None

    def _step_inner(self) -> None:
        """AdamW at the scheduled lr times ``adam_lr_ratio``, then Muon (if any) at the scheduled lr."""
        scheduled = [g["lr"] for g in self.inner.param_groups]
        for g in self.inner.param_groups:
            g["lr"] = g["lr"] * self.adam_lr_ratio
        try:
            self.inner.step()
        finally:
            for g, lr in zip(self.inner.param_groups, scheduled):
                g["lr"] = lr
        if self.muon is not None:
            group = self.param_groups[-1]
            self.muon.step(group["lr"], group["weight_decay"])

    def _release_fsdp_grads(self) -> None:
        """FSDP: the gradients belong to the parameters, which drop them at the next zero_grad;
        holding them here too would keep them alive through the next backward."""
        if self.fsdp:
            for pc in self.pieces:
                pc.main.grad = None

    def _write_back(self) -> None:
        if self.fsdp:  # Adam updated the sharded parameters in place; FSDP gathers them at the next forward
            return
        if not self.distributed:
            if self.separate:
                for pc in self.pieces:
                    pc.param.copy_(pc.main)
            return
        for bucket, at in self._main_shards:
            if self.separate:
                size = bucket.shard_end - bucket.shard_start
                self.param_buffer[bucket.shard_start:bucket.shard_end].copy_(self.main_buffer[at:at + size])
        # Buckets are laid out from the last parameters registered to the first, and a group's
        # collectives complete in issue order: issuing the last bucket first lets the first modules
        # of the next forward (and the first pipeline chunk) start after their own gathers only.
        for i in reversed(range(len(self.buffer.buckets))):
            bucket = self.buffer.buckets[i]
            if bucket.size > 1:
                self._gathers[i] = C.all_gather_into(self.param_buffer[bucket.start:bucket.end],
                                                     self.param_buffer[bucket.shard_start:bucket.shard_end],
                                                     bucket.group, "dp_all_gather")
        if not self.overlap_param_gather:
            self.finish_param_gather()

    @torch.compiler.disable
    def _before_forward(self, module: nn.Module, args) -> None:
        """Wait for the gathers of ``module``'s own buckets. Outside ``torch.compile``'s graphs
        (``trainer.compile``): dynamo would otherwise trace the pending ``Work.wait`` and the
        dict of handles into the compiled blocks."""
        for i in self._wait_for.get(module, ()):
            handle = self._gathers.pop(i, None)
            if handle is not None:
                handle.wait()

    def close(self) -> None:
        """End of training: let the last step's gathers land, and detach from the model."""
        self.finish_param_gather()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def finish_param_gather(self) -> None:
        """Wait for every pending parameter all-gather (before reading parameters outside a forward)."""
        for handle in self._gathers.values():
            handle.wait()
        self._gathers.clear()

    # Checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The inner AdamW's and Muon's momentum buffers in order (same-layout only;
        ``checkpoint.sharded`` writes layout-free ones)."""
        sd = self.inner.state_dict()
        if self.muon is not None:
            sd["muon"] = [{k: v.clone() for k, v in self.muon.init_state(m).items()} for m in self.muon.mains]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        muon = state_dict.pop("muon", None)
        self.inner.load_state_dict(state_dict)
        if self.muon is not None and muon is not None:
            for main, saved in zip(self.muon.mains, muon):
                for k, v in self.muon.init_state(main).items():
                    v.copy_(saved[k])

    def _piece_state(self, pc: Piece, step_dtype: torch.dtype) -> dict:
        """This piece's Adam state, created (zero) as the inner optimizer would when missing, so
        that loading can fill it in place. torch keeps ``step`` per parameter; apex's FusedAdam
        keeps one count per param group (``group["step"]``, see ``_step``). A Muon matrix's state
        is its momentum buffer and step count."""
        if id(pc) in self._muon_of:
            if self.distributed:
                return self.muon.piece_state(pc, step_dtype)
            return self.muon.init_state(pc.main, step_dtype)
        state = self.inner.state[pc.main]
        if not state:
            if self.impl != "apex":  # the fused kernel reads it on the parameter's device
                device = pc.main.device if self.impl == "fused" else "cpu"
                state["step"] = torch.zeros((), dtype=step_dtype, device=device)
            for key in ADAM_KEYS:
                state[key] = torch.zeros_like(pc.main, memory_format=torch.preserve_format)
        return state

    def init_state(self, step_dtype: torch.dtype = torch.float32) -> None:
        """Create Adam's state now, as the first step would: a run's steady step (from its second,
        or the first after a resume) starts with it allocated, which the dry run measures."""
        for pc in self.pieces:
            self._piece_state(pc, step_dtype)
        if isinstance(self.muon, OwnedMuon):
            for p in self.muon.mains:
                self.muon.init_state(p, step_dtype)

    def _group(self, pc: Piece) -> dict:
        return next(g for g in self.inner.param_groups if any(p is pc.main for p in g["params"]))

    def _step(self, pc: Piece, state: dict, step_dtype: torch.dtype) -> torch.Tensor:
        """The piece's step count as a tensor: torch's own (live), or apex's group count (a copy)."""
        if self.impl == "apex" and id(pc) not in self._muon_of:
            return torch.tensor(float(self._group(pc).get("step", 0)), dtype=step_dtype)
        return state["step"]

    def _set_step(self, pc: Piece, state: dict, value: torch.Tensor) -> None:
        """Store a loaded step count where, and as, the inner optimizer keeps it: apex an int per
        group; torch's fused kernel a float32 tensor on the parameter's device; the others a CPU
        tensor."""
        if id(pc) in self._muon_of and self.distributed:
            self.muon.set_step(pc.param, value)
        elif id(pc) in self._muon_of:
            state["step"] = value.detach().to("cpu", copy=True)
        elif self.impl == "apex":
            self._group(pc)["step"] = int(value.item())
        elif self.impl == "fused":
            state["step"] = value.to(device=pc.main.device, dtype=torch.float32, copy=True)
        elif value is not state["step"]:
            state["step"] = value.detach().to("cpu", copy=True)

    def checkpoint_pieces(self, step_dtype: torch.dtype = torch.float32) -> List["StatePiece"]:
        """This rank's optimizer state, piece by piece: each a flat range of a model parameter with
        its step count and flat views of its live tensors (``exp_avg``, ``exp_avg_sq`` and, for
        16-bit models, the fp32 ``main`` weights). Nothing is copied or gathered: a checkpoint
        writes the views, and loading fills them in place (then ``load_steps``). Not distributed,
        each piece is a whole parameter; distributed, only the ranges this rank owns (of an expert
        parameter: its share over the expert data-parallel group; ``StatePiece``)."""
        self.finish_param_gather()
        out = []
        for pc in self.pieces:
            state = self._piece_state(pc, step_dtype)
            keys = MUON_KEYS if id(pc) in self._muon_of else ADAM_KEYS
            tensors = {k: state[k].view(-1) for k in keys if k in state}  # a Muon shard: its owner has the momentum
            if self.separate:
                tensors["main"] = pc.main.data.view(-1)
            out.append(StatePiece(pc.param, pc.lo, pc.hi, self._step(pc, state, step_dtype), tensors))
        if isinstance(self.muon, OwnedMuon):
            out += self.muon.checkpoint_pieces(step_dtype, StatePiece)
        return out

    def load_steps(self, steps: Dict[nn.Parameter, torch.Tensor]) -> None:
        """Store loaded step counts (per model parameter) where the implementation keeps them."""
        for pc in self.pieces:
            if pc.param in steps:
                self._set_step(pc, self._piece_state(pc, steps[pc.param].dtype), steps[pc.param])
        if isinstance(self.muon, OwnedMuon):  # an owned matrix may have no shard piece here
            for p in self.muon.mains:
                if p in steps:
                    self.muon.set_step(p, steps[p])

    @torch.no_grad()
    def reload_main_from_model(self) -> None:
        """Reset the fp32 main weights from the model's (after loading a checkpoint without them)."""
        if not self.separate:
            return
        for pc in self.pieces:
            pc.main.data.copy_(pc.param.detach().reshape(-1)[pc.lo:pc.hi].view_as(pc.main))

    def optimizer_bytes(self) -> int:
        """Bytes of Adam state this rank holds (after the first step or a load)."""
        adam = sum(t.numel() * t.element_size()
                   for s in self.inner.state.values() for k, t in s.items() if k in ADAM_KEYS)
        return adam + (self.muon.state_bytes() if self.muon is not None else 0)

    def main_weight_bytes(self) -> int:
        """Bytes of fp32 main weights this rank holds beyond the model's own parameters."""
        if not self.separate:
            return 0
        if self.distributed:
            return self.main_buffer.numel() * self.main_buffer.element_size()
        return sum(pc.main.numel() * pc.main.element_size() for pc in self.pieces)
