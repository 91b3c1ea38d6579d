"""Pipeline parallelism: which model stages a rank holds, and the schedule that runs them.

Stages. The model is cut into ``pp x vpp`` virtual stages in model order (``Derived.layers_per_stage``
gives the layers of each). With the looped schedules (Megatron's interleaving) chunk ``c`` of
pipeline rank ``p`` is virtual stage ``c * pp + p``; with ZB-V (``zbv``) rank ``p`` holds stages
``p`` and ``2 pp - 1 - p``, a V, so rank 0 holds both the first and the last stage.

Schedules: ``torch.distributed.pipelining``. Its ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble`` (ZB1P) and ``ScheduleZBVZeroBubble`` drive our stage modules
unchanged: a stage is a ``GPTModel`` built with its layers, taking one tensor (tokens or the
previous stage's hidden state, this TP rank's sequence slice under sequence parallelism) and
returning one. TP collectives inside a stage stay matched because every TP rank of a stage runs
the same schedule in the same order; the zero-bubble split of backward into input- and
weight-gradient passes keeps every collective on the input path (they sit between activations,
weights are leaves). Point-to-point goes over ``ParallelState``'s ``pp`` group. Tests hold the
result to the single-process run at 1e-9 in float64 for every schedule, with TP, sequence
parallelism and DP around it; PyTorch maintains the schedules, so writing our own would only add
code to maintain. What we need beyond its public API sits in ``pipeline_runtime``. Limits we inherit and check in ``config.derive``:
1F1B needs ``num_microbatches >= pp``; the looped schedules need ``num_microbatches`` to be a
multiple of ``max(1, num_microbatches // pp)`` (torch's "rounds"); ZB-V needs two stages per rank.
Torch's 1F1B warms up with ``pp`` forwards on the first stage (Megatron: ``pp - 1``), so at most
``pp`` micro-batches' activations live there at once. Two torch quirks are handled here: its
point-to-point sends refuse strided tensors, which a sequence-parallel stage may output
(``_Stage`` makes outputs and input grads contiguous); and its runtime schedules walk the backward
actions even in ``eval()``, which fails for ZB-V, so evaluation runs a second schedule cut down to
its forward actions (``pipeline_runtime.keep_forward_actions``).

Loss. The last stage's module returns the per-token loss (labels reach every stage as a keyword
argument; only the last uses them) and the schedule's ``loss_fn`` reduces it to the micro-batch's
masked mean (``loss_mask`` is the schedule's target). The schedule runs with ``scale_grads=False``:
the caller divides the accumulated grads by the number of micro-batches, on the buffered grads
(``data_parallel.main_grad``), which the schedule's ``scale_grads`` does not see (a 16-bit model
accumulates in an fp32 buffer): ``GradBuffer.finish`` does it after its reduce, FSDP's step after
its reduce-scatter. The step's loss is summed over the pp group from the last stage (others add
zero), so every rank, rank 0 included, holds it.

Data-parallel overlap (``overlap_grad_reduce``, ``parallel.overlap_grad_reduce``). A chunk's grads
are final after its last micro-batch's backward (1F1B, interleaved) or last W pass (zero-bubble,
ZB-V), while the schedule still runs the other chunks and micro-batches: the gradient buffer is
told then (``_ReduceWhenFinal``, called around every computation by ``HookedStage``), and each of
its buckets starts reducing as soon as all its parameters are final, per chunk, so the reduce of
later stages' layers overlaps the backward of earlier ones. The tied embedding's copies are never
declared final here: their buckets start after ``reduce_tied_grads``, in the buffer's ``finish``.

Tied embeddings. The last stage holds its own copy of the word embedding (parameters tagged
``shared_embedding``); after the schedule the copies' grads are summed over the ``embedding``
group (first + last stage, Megatron's scheme), or locally when one rank holds both (ZB-V), so the
copies receive identical updates and stay bitwise equal (``reduce_tied_grads``, which the step
calls after the schedule).

FSDP (``parallel.data_parallel=fsdp``). Every micro-batch's backward runs with FSDP's gradient
sync off (the step's ``no_sync``), and one reduce-scatter per chunk follows the schedule
(``fsdp.finish_backward``, the step's call); the division by the micro-batch count and the tied
embedding's sum then act on this rank's rows of the reduced grads, which are the same rows on the
first and last stage.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.data_parallel import main_grad
from megatron_hydra.parallel.pipeline_runtime import (
    HookedStage,
    check_supported,
    keep_forward_actions,
)
from megatron_hydra.parallel.state import ParallelState

SCHEDULES = {
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


def stage_indices(pp_rank: int, pp: int, vpp: int, schedule: str) -> List[int]:
    """The virtual stages rank ``pp_rank`` holds, in the order of its chunks."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [chunk * pp + pp_rank for chunk in range(vpp)]


def stage_layers(layers_per_stage: Sequence[int], stage: int) -> range:
    """Global indices of the layers of virtual stage ``stage``."""
    start = sum(layers_per_stage[:stage])
    return range(start, start + layers_per_stage[stage])


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _Stage(nn.Module):
    """A chunk as torch's ``PipelineStage`` needs it: point-to-point sends only contiguous tensors,
    while a stage's output (or its input's gradient) may be a strided view, e.g. the result of a
    sequence-parallel reduce-scatter."""

    def __init__(self, chunk: nn.Module):
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        if x.requires_grad:
            x = _ContiguousGrad.apply(x)
        return self.chunk(x, **kwargs).contiguous()


def _fold_weight_grads(stage) -> None:
    """After a zero-bubble W pass, which adds weight grads to ``.grad`` by hand (no accumulate
    hook fires): fold a 16-bit model's grads into its fp32 buffer now, so that micro-batches sum
    in fp32."""
    for p in stage.submod.parameters():
        main_grad(p)


class _ReduceWhenFinal:
    """Tells ``buffer`` when each chunk's grads are final (module docstring): before the chunk's
    last full backward its parameters are armed (the buffer's accumulate hook then counts them);
    after its last W pass, which adds grads by hand, they are declared ready. Counting the
    computations that finish a micro-batch's weight grads (B or W) needs no knowledge of the
    schedule's order. ``params``: stage index -> its parameters, tied ones left out."""

    def __init__(self, buffer, params: dict, num_microbatches: int):
        self.buffer, self.params, self.m = buffer, params, num_microbatches
        self.reset()

    def reset(self) -> None:
        self.done = dict.fromkeys(self.params, 0)

    def before(self, stage_index: int, kind: str) -> None:
        if kind == "B" and self.done[stage_index] == self.m - 1:
            self.buffer.arm(self.params[stage_index])

    def after(self, stage_index: int, kind: str) -> None:
        if kind not in ("B", "W"):
            return
        self.done[stage_index] += 1
        if kind == "W" and self.done[stage_index] == self.m:
            self.buffer.ready(self.params[stage_index])


class Pipeline:
    """This rank's model chunks as pipeline stages, with one training and one evaluation schedule.

    ``loss_fn(per_token_loss, loss_mask)`` reduces a micro-batch on the last stage. Setting
    ``events`` to a list records every computation of the training schedule as
    ``(stage, kind, micro-batch, start, end)`` with kind F (forward), B (backward), I and W (the
    input- and weight-gradient halves of a zero-bubble backward), for tests and benchmarks; it
    only observes (``pipeline_runtime.HookedStage.on_action``). Each computation is also marked
    (``collectives.mark``) among the collectives where they are recorded (``record_comm``), so a
    test can tell which collective was issued before which computation ended."""

    def __init__(self, chunks: Sequence[nn.Module], stages: Sequence[int], ps: ParallelState, schedule: str,
                 num_microbatches: int, loss_fn: Callable, device: torch.device,
                 stage_io: Optional[Callable[[int], tuple]] = None):
        self.chunks, self.stages, self.ps = list(chunks), list(stages), ps
        self.schedule_name, self.num_microbatches = schedule, num_microbatches
        self.loss_fn, self.device = loss_fn, device
        # stage index -> (input, output) meta tensors of one micro-batch: stages that know their
        # shapes skip torch's shape inference (a point-to-point round of metadata at the first step).
        self.stage_io = stage_io
        check_supported()
        self.num_stages = ps.pp_size * len(self.chunks)
        self.holds_last = self.num_stages - 1 in self.stages
        self.events: Optional[list] = None
        self._train_stages: List[HookedStage] = []
        self._train = self._build(train=True)
        self._eval = None  # built on first use: its stages keep their own (gradient-free) buffers
        self.tied = [p for c in self.chunks for p in c.parameters() if getattr(p, "shared_embedding", False)]
        self._final: Optional[_ReduceWhenFinal] = None

    def overlap_grad_reduce(self, buffer) -> None:
        """Start ``buffer``'s (a ``data_parallel.GradBuffer``) bucket reduces during the schedule,
        each as soon as its grads are final (module docstring); the buffer's ``overlap`` says
        whether it starts them then or all in ``finish``."""
        params = {index: [p for p in chunk.parameters() if not getattr(p, "shared_embedding", False)]
                  for chunk, index in zip(self.chunks, self.stages)}
        self._final = _ReduceWhenFinal(buffer, params, self.num_microbatches)
        for stage in self._train_stages:
            stage.grad_hooks = self._final

    def _build(self, train: bool):
        io = {index: self.stage_io(index) if self.stage_io else (None, None) for index in self.stages}
        stages = [HookedStage(_Stage(chunk), index, self.num_stages, self.device, group=self.ps.pp_group,
                              input_args=io[index][0], output_args=io[index][1], after_weight_grads=_fold_weight_grads)
                  for chunk, index in zip(self.chunks, self.stages)]
        for stage in stages if train else ():
            stage.on_action = self._record
        if train:
            self._train_stages = stages
        cls = SCHEDULES[self.schedule_name]
        first = stages[0] if cls is Schedule1F1B else stages
        schedule = cls(first, self.num_microbatches, loss_fn=self.loss_fn, scale_grads=False)
        if not train:
            keep_forward_actions(schedule)
        return schedule

    def _record(self, stage: int, kind: str, mb: int, start: float, end: float) -> None:
        C.mark(f"{kind}{stage}.{mb}")  # in the order of the collectives, where they are recorded
        if self.events is not None:
            self.events.append((stage, kind, mb, start, end))

    def _run(self, schedule, tokens, labels, loss_mask, train: bool, inputs: dict) -> torch.Tensor:
        losses: List[torch.Tensor] = []
        run = schedule.step if train else schedule.eval
        run(tokens, target=loss_mask, losses=losses, return_outputs=False, labels=labels, **inputs)
        # Summed in fp32 (fp64 for fp64 models): 16-bit would round the loss, or overflow once fp16's
        # loss scale is in it.
        dtype = torch.float64 if next(self.chunks[0].parameters()).dtype == torch.float64 else torch.float32
        loss = torch.zeros((), dtype=dtype, device=self.device)
        if self.holds_last:
            for value in losses:  # summed in micro-batch order, as the pp=1 loop does
                loss += value.detach()
            loss /= self.num_microbatches
        return C.all_reduce(loss, self.ps.pp_group)

    def train_step(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                   **inputs: torch.Tensor) -> torch.Tensor:
        """Forward and backward of all micro-batches of this rank's batch; grads accumulate, summed
        over micro-batches (averaging them and summing the tied copies is the caller's: see the
        module docstring). Returns the mean loss. ``inputs`` (e.g. BERT's padding mask) reach every
        stage as keyword arguments, like labels."""
        if self._final is not None:
            self._final.reset()
        return self._run(self._train, tokens, labels, loss_mask, True, inputs)

    def eval_step(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                  **inputs: torch.Tensor) -> torch.Tensor:
        if self._eval is None:
            self._eval = self._build(train=False)
        return self._run(self._eval, tokens, labels, loss_mask, False, inputs)

    @torch.no_grad()
    def reduce_tied_grads(self) -> None:
        """Sum the grads of the tied embedding's copies (first and last stage)."""
        grads = [g for g in map(main_grad, self.tied) if g is not None]
        if len(grads) == 2:  # both copies on this rank (ZB-V): the sum is the same tensor on both
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif len(grads) == 1 and self.schedule_name != "zbv":
            C.all_reduce(grads[0], self.ps.group("embedding"))
