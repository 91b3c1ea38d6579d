"""The one place that touches the non-public side of ``torch.distributed.pipelining``.

Three things we need are not public API in torch 2.6-2.13:

- **A callback before and after each computation of a stage.** Zero-bubble schedules add weight
  gradients to ``.grad`` by hand in their W pass (no accumulate hook fires), so a 16-bit model
  must fold them into its fp32 buffer right after each W pass, or micro-batches would sum in 16
  bits. The data-parallel overlap needs to know when a chunk's last backward (or W pass) starts
  and ends, to start reducing its buckets there. The same callback times computations for the
  bubble measurements. ``HookedStage`` overrides ``PipelineStage``'s per-chunk methods to
  provide it.
- **A forward-only copy of a runtime schedule.** Torch's runtime schedules (interleaved
  zero-bubble, ZB-V) walk their whole action list even under ``eval()``, and a V schedule's
  backward actions then fail. ``keep_forward_actions`` keeps the forward actions only.
- **The schedule's own action order.** ``action_orders`` reads the per-rank list of computations
  a runtime schedule will run (torch keeps it as ``pipeline_order``), for the contention-free
  bubble count (``planning.schedule_bubble``).
- **A settled warm-up vote, for the dry run only.** Before its first step a schedule has its
  stages vote, point to point, whether every stage knows its shapes. The dry run's fake process
  group delivers nothing, so its vote would read a zero; ``warmup_vote_settled`` stands in for
  the vote while the dry run holds it open. Training never enters it.

``check_supported()`` verifies these names exist before a pipeline is built, so a torch release
that moved them fails with one line rather than deep inside a schedule.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch
from torch.distributed import pipelining
from torch.distributed.pipelining import schedules as _schedules

from megatron_hydra.errors import ConfigError

SUPPORTED = "2.6 to 2.13"
_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
_STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def check_supported() -> None:
    """One-line ConfigError if this torch lacks what the pipeline adapter relies on."""
    missing = [m for m in _STAGE_METHODS if not hasattr(pipelining.PipelineStage, m)]
    missing += [n for n in ("_ComputationType", "_PipelineScheduleRuntime") if not hasattr(_schedules, n)]
    if not any(hasattr(c, "_warmup_p2p") for c in (_schedules.PipelineScheduleSingle, _schedules.PipelineScheduleMulti)):
        missing.append("_warmup_p2p")
    if missing:
        raise ConfigError(
            f"pipeline parallelism (parallel.pipeline_model_parallel_size > 1) needs torch.distributed.pipelining as in "
            f"torch {SUPPORTED}; torch {torch.__version__} lacks {', '.join(missing)}: install a supported torch or use pp=1"
        )


# Hook signature: (stage_index, kind, micro_batch, start_seconds, end_seconds); kind is F (forward),
# B (full backward), I (input-gradient half of a zero-bubble backward) or W (its weight half).
ActionHook = Callable[[int, str, int, float, float], None]


class GradHooks(Protocol):
    """What a stage tells about its gradients (``pipeline``'s data-parallel overlap): ``before``
    and ``after`` each computation of kind F, B, I or W on stage ``stage_index``."""

    def before(self, stage_index: int, kind: str) -> None: ...

    def after(self, stage_index: int, kind: str) -> None: ...


class HookedStage(pipelining.PipelineStage):
    """``PipelineStage`` that calls ``after_weight_grads(stage)`` after every W pass (correctness),
    ``grad_hooks`` around every computation when set (the data-parallel overlap; after the fold)
    and ``on_action(...)`` after every computation when it is set (instrumentation)."""

    def __init__(self, *args, after_weight_grads: Callable[[pipelining.PipelineStage], None], **kwargs):
        super().__init__(*args, **kwargs)
        self.after_weight_grads = after_weight_grads
        self.grad_hooks: Optional[GradHooks] = None
        self.on_action: Optional[ActionHook] = None

    def _timed(self, kind: str, method, mb: int, *args, **kwargs):
        if kind == "B" and not kwargs.get("full_backward", True):
            kind = "I"
        if self.grad_hooks is not None:
            self.grad_hooks.before(self.stage_index, kind)
        start = time.perf_counter()
        out = method(mb, *args, **kwargs)
        if kind == "W":
            self.after_weight_grads(self)
        if self.grad_hooks is not None:
            self.grad_hooks.after(self.stage_index, kind)
        if self.on_action is not None:
            self.on_action(self.stage_index, kind, mb, start, time.perf_counter())
        return out

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return self._timed("F", super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed("B", super().backward_one_chunk, bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self._timed("W", super().backward_weight_one_chunk, bwd_chunk_id, *args, **kwargs)


def keep_forward_actions(schedule) -> None:
    """Cut a runtime schedule's action lists down to their forward part (for evaluation): a
    dependency-closed part of a deadlock-free schedule, hence deadlock-free itself."""
    if not isinstance(schedule, _schedules._PipelineScheduleRuntime):
        return
    t = _schedules._ComputationType
    forward = (t.FORWARD, t.SEND_F, t.RECV_F, t.UNSHARD, t.RESHARD)
    order = schedule.pipeline_order_with_comms
    for rank, actions in order.items():
        order[rank] = [a for a in actions if a.computation_type in forward]


def _settled_vote(schedule, stages, has_backward: bool, p2p_done: bool) -> None:
    """Torch's pipeline warm-up vote as the job's ranks would settle it. Before its first step a
    schedule has its stages vote, point to point, whether every stage knows its shapes (then none
    infers them at run time). The fake group delivers nothing, so the vote would read a zero and
    fall back to run-time inference, whose metadata exchange cannot work there either. Every rank
    builds its stages alike, so when this rank's stages all know their shapes, so do the job's."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import InferenceMode

    known = all(isinstance(s, PipelineStage) and not InferenceMode.needs_dynamic(s._user_meta, has_backward)
                for s in stages)
    if not known:
        vote = next(_VOTES[c] for c in type(schedule).__mro__ if c in _VOTES)
        return vote(schedule, stages, has_backward, p2p_done)
    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


# The classes defining torch's vote (``_warmup_p2p``), each with its own; empty where torch has none.
_VOTES: dict = {}


def warmup_vote_settled() -> ExitStack:
    """``_settled_vote`` in place of torch's pipeline warm-up vote, for as long as the returned
    stack is open: what the dry run's fake process group needs (it moves no data, so the vote
    would read a zero). Only the dry run enters it."""
    from unittest import mock

    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        owner = next((c for c in cls.__mro__ if "_warmup_p2p" in vars(c)), None)
        if owner is not None and owner not in _VOTES:
            _VOTES[owner] = vars(owner)["_warmup_p2p"]
    stack = ExitStack()
    for owner in _VOTES:
        stack.enter_context(mock.patch.object(owner, "_warmup_p2p", _settled_vote))
    return stack


def action_orders(schedule_cls, stages_of: Callable[[int], List[int]], pp: int, num_stages: int,
                  num_microbatches: int) -> Dict[int, List[Tuple[str, int, int]]]:
    """Per pipeline rank, the computations ``schedule_cls`` runs in order, as (kind, stage,
    micro-batch) with kind F, B (full backward), I or W (zero-bubble halves); communication
    actions are left out. ``stages_of(rank)``: the stages a rank holds. A runtime schedule is
    built for rank 0 on torch's fake process group in this process (nothing is computed or sent;
    it needs a process without a default process group) and its ``pipeline_order`` read. 1F1B
    keeps no order (its ``_get_pipeline_order`` display helper is a micro-batch off on later ranks
    in torch 2.13): its order is the loop of ``Schedule1F1B._step_microbatches``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if schedule_cls is pipelining.Schedule1F1B:
        return {rank: _one_f_one_b(rank, pp, num_microbatches) for rank in range(pp)}
    if dist.is_initialized():
        raise RuntimeError("action_orders builds its own (fake) process group: call it where none is initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        stages = [pipelining.PipelineStage(torch.nn.Identity(), index, num_stages, torch.device("cpu"))
                  for index in stages_of(0)]
        order = schedule_cls(stages, num_microbatches, loss_fn=lambda out, target: out).pipeline_order
    finally:
        dist.destroy_process_group()
    out = {}
    for rank, actions in order.items():
        out[rank] = [(_KINDS[a.computation_type.name], a.stage_index, a.microbatch_index) for a in actions
                     if a is not None and a.computation_type.name in _KINDS]
    return out


def _one_f_one_b(rank: int, pp: int, m: int) -> List[Tuple[str, int, int]]:
    """Torch's 1F1B on stage ``rank``: ``min(m, pp - rank)`` warm-up forwards, then one backward
    and one forward at a time until the forwards run out, then the remaining backwards."""
    warmup = min(m, pp - rank)
    out = [("F", rank, j) for j in range(warmup)]
    for j in range(m):
        out.append(("B", rank, j))
        if warmup + j < m:
            out.append(("F", rank, warmup + j))
    return out
