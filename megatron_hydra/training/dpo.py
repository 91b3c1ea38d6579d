"""Direct Preference Optimization (``objective=dpo``; Rafailov et al. 2023) at any layout.

A preference batch (``data=preference``) packs pairs into rows: in a row, document ``2j`` is a
prompt with its chosen answer, ``2j + 1`` the same prompt with its rejected answer, and the loss
mask covers the answers' tokens alone; a padding document may follow. A document's log-probability
is the sum over its loss tokens of ``log p(label)``, the negated per-token loss the model already
returns, summed per document (``document_logps``). The loss of a pair, with ``z = beta * ((pi(c) -
ref(c)) - (pi(r) - ref(r)))``, is ``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)`` (``eps``:
``objective.label_smoothing``, the conservative variant); a micro-batch's loss is the mean over
its pairs, and the step's the mean over micro-batches, as the lm objective's, so that it is the
same at every layout.

The reference model (``Reference``) is the starting model. Under ``peft=lora`` it is the policy
itself with its adapters off (``models.lora.adapters_off``): no second copy; a run that starts from
trained adapters (``peft.adapter``: SFT with LoRA, then DPO) starts from base + those adapters, so
the reference keeps a copy of them (adapter-sized) and swaps it in for its pass. Otherwise it is a
frozen copy built as the policy is (same stages, same shards, FSDP-sharded like it), loaded from
``checkpoint.load`` by the worker (``training.train``), or left at the seeded initial weights the
policy starts from; it is never in the optimizer or in a checkpoint. Before a step trains, the
reference runs forward only (no grad, eval mode: no dropout, no MoE bias statistics) over this
rank's batch, through the same layout: micro-batch by micro-batch, or with pipeline parallelism a
forward-only schedule whose loss function on the last stage records each micro-batch's document
sums into their rows, found by a row index carried in the schedule's target, not by call order.
The training micro-batches then carry their rows' reference sums the same way.

Context parallelism gives each rank chunks of every document: the per-document sums are summed
over the cp group, the value whole, the gradient this rank's tokens' own. Each cp rank's loss
then carries cp times the gradient (the reduce averages over dp x cp, as ``masked_mean``'s
shares are scaled for) but the whole loss as its value, so the logged loss needs no correction.

Metrics (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracy``):
over every pair of the global batch; each micro-batch adds its sums to ``DPOLoss.stats`` on the
device, and the logging step reduces and reads them with the step's other values.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.checkpoint import sharded
from megatron_hydra.models.lora import adapters_off
from megatron_hydra.models.stages import build_model, build_stage_chunks
from megatron_hydra.models.transformer import Block
from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel import fsdp
from megatron_hydra.parallel.lora import is_adapter
from megatron_hydra.parallel.pipeline import Pipeline
from megatron_hydra.training.step import model_chunks, split_microbatches

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy")
REFERENCE = "reference_logps"  # the batch field of each row's reference document sums


def document_totals(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, document_ids: torch.Tensor,
                    width: int, cp_group=None):
    """Per row, each document's log-prob sum and loss-token count, ``[rows, width]`` each (document
    ``d`` at column ``d``), over the whole sequences under context parallelism. The sums keep the
    gradient of this rank's tokens alone."""
    mask = loss_mask.to(per_token_loss.dtype)
    index = document_ids.long()
    local = per_token_loss.new_zeros(index.shape[0], width).scatter_add(1, index, -(per_token_loss * mask))
    counts = mask.new_zeros(index.shape[0], width).scatter_add(1, index, mask)
    if C.group_size(cp_group) == 1:
        return local, counts
    whole = C.all_reduce(torch.stack([local.detach(), counts]), cp_group)
    return local + (whole[0] - local.detach()), whole[1]


def _pairs(values: torch.Tensor) -> torch.Tensor:
    """``[rows, width]`` per document as ``[rows, width // 2, 2]``: (chosen, rejected) per pair."""
    pairs = values.shape[1] // 2
    return values[:, :2 * pairs].reshape(values.shape[0], pairs, 2)


class DPOLoss:
    """A micro-batch's DPO loss from the policy's per-token loss and the rows' reference sums.
    ``stats``: where the step's reward sums go (None: nowhere, e.g. validation)."""

    def __init__(self, beta: float, label_smoothing: float, width: int, cp_group=None):
        self.beta, self.eps, self.width, self.cp_group = beta, label_smoothing, width, cp_group
        self.stats: Optional[torch.Tensor] = None  # chosen, rejected, correct, pairs: summed

    def start_step(self, dtype: torch.dtype, device) -> None:
        self.stats = torch.zeros(4, dtype=dtype, device=device)

    def __call__(self, per_token_loss: torch.Tensor, loss_mask: torch.Tensor, document_ids: torch.Tensor,
                 reference: torch.Tensor) -> torch.Tensor:
        dtype = reference.dtype
        policy, counts = document_totals(per_token_loss.to(dtype), loss_mask, document_ids, self.width, self.cp_group)
        valid = (_pairs(counts) > 0).all(-1).to(dtype)  # both answers have loss tokens; padding has none
        rewards = self.beta * (_pairs(policy) - _pairs(reference.to(dtype)))
        chosen, rejected = rewards.unbind(-1)
        logits = chosen - rejected
        losses = -(1 - self.eps) * F.logsigmoid(logits) - self.eps * F.logsigmoid(-logits)
        n = valid.sum()
        loss = (losses * valid).sum() / n.clamp_min(1)
        if self.stats is not None:
            with torch.no_grad():
                self.stats += torch.stack([(chosen * valid).sum(), (rejected * valid).sum(),
                                           ((chosen > rejected).to(dtype) * valid).sum(), n]).to(self.stats.dtype)
        cp = C.group_size(self.cp_group)
        return loss if cp == 1 else loss + (cp - 1) * (loss - loss.detach())  # value: the loss; gradient: cp x

    def metrics(self, ps, device) -> List[torch.Tensor]:
        """The step's mean rewards, margin and accuracy over every pair of the global batch, as
        device scalars (collective: every rank; summed from the last stage over the pp group, then
        over dp x cp, where every cp rank counted the same pairs)."""
        stats = torch.zeros(4, dtype=torch.float64, device=device) if self.stats is None else \
            self.stats.detach().to(device, torch.float64).clone()
        C.all_reduce(stats, ps.pp_group)
        C.all_reduce(stats, ps.dp_cp_group)
        n = stats[3].clamp_min(1.0)
        chosen, rejected = stats[0] / n, stats[1] / n
        return [chosen, rejected, chosen - rejected, stats[2] / n]


@contextmanager
def _forward_only(chunks: List[nn.Module], adapters) -> Iterator[None]:
    """No grad, eval mode (no dropout, no MoE statistics), inside ``adapters`` (the reference's
    adapters under LoRA, else a null context). Every module's mode is put back after."""
    modes = [(m, m.training) for chunk in chunks for m in chunk.modules()]
    try:
        with torch.no_grad(), adapters:
            for chunk in chunks:
                chunk.eval()
            yield
    finally:
        for module, training in modes:
            module.training = training


@contextmanager
def _swapped(params: List[nn.Parameter], values: List[torch.Tensor]) -> Iterator[None]:
    """``params`` hold ``values`` inside (their storage swapped, nothing copied), their own after."""
    own = [p.data for p in params]
    try:
        for p, v in zip(params, values):
            p.data = v
        yield
    finally:
        for p, v in zip(params, own):
            p.data = v


class Reference:
    """The reference model of ``module`` (an ``LMModule``) and its forward-only pass (the module
    docstring). ``copy``: the frozen copy's chunks, None under LoRA."""

    def __init__(self, module, device=None):
        self.module = module
        self.lora = module.derived.transformer.lora is not None
        self.copy: Optional[List[nn.Module]] = None if self.lora else _frozen_copy(module, device)
        # Under LoRA from trained adapters (peft.adapter): their values, to swap in for the pass.
        self.start_adapters: Optional[List[torch.Tensor]] = None
        self._fsdp_units = fsdp.fsdp_modules(self.copy or ())
        self._pipeline = None
        self._out: Optional[torch.Tensor] = None  # the pipeline pass's rows, filled on the last stage

    @property
    def chunks(self) -> List[nn.Module]:
        return self.copy if self.copy is not None else model_chunks(self.module.model)

    def load(self, base: Optional[str], adapter: Optional[str]) -> None:
        """The starting weights (collective: every rank): the copy's from the checkpoint ``base``
        (``checkpoint.load``); under LoRA, the adapters of ``adapter`` (``peft.adapter``), read into
        the policy's (which the run then loads again, from where it resumes) and kept aside."""
        m = self.module
        if self.copy is not None and base:
            model = nn.ModuleList(self.copy) if m.derived.pp > 1 else self.copy[0]
            sharded.load(base, model, None, m.ps, m.derived.transformer.vocab_size, load_optimizer=False)
        if self.lora and adapter:
            sharded.load(adapter, m.model, None, m.ps, m.derived.transformer.vocab_size, load_optimizer=False,
                         select="adapters", key="peft.adapter")
            self.start_adapters = [p.detach().clone() for p in self._adapter_params()]

    def _adapter_params(self) -> List[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters() if is_adapter(p)]

    def _adapters(self):
        """The reference's adapters: off, or the starting ones swapped in (``load``)."""
        if not self.lora:
            return nullcontext()
        if self.start_adapters is None:
            return adapters_off(self.chunks)
        return _swapped(self._adapter_params(), self.start_adapters)

    def __call__(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """``[rows, seq_length]``: each row's reference document sums (document ``d`` at column
        ``d``); with pipeline parallelism meaningful on the last stage alone, the one that reads it."""
        with _forward_only(self.chunks, self._adapters()):
            out = self._pipelined(batch) if self.module.derived.pp > 1 else self._looped(batch)
        for unit in self._fsdp_units:  # FSDP keeps a root gathered after forward, for a backward
            unit.reshard()
        return out

    def _looped(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        m = self.module
        model, inputs = self.chunks[0], m.model_inputs
        rows = []
        for mb in split_microbatches(batch, m.derived.num_microbatches):
            out = model(mb["tokens"], **inputs(mb)).to(m.loss_dtype)
            rows.append(document_totals(out, mb["loss_mask"], mb["document_ids"], m.dpo.width, m.ps.cp_group)[0])
        return torch.cat(rows)

    def _pipelined(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        m = self.module
        tokens = batch["tokens"]
        dtype = m.loss_dtype
        self._out = torch.zeros(tokens.shape[0], m.dpo.width, dtype=dtype, device=tokens.device)
        rows = torch.arange(tokens.shape[0], device=tokens.device, dtype=dtype)[:, None]
        target = torch.cat([batch["loss_mask"].to(dtype), batch["document_ids"].to(dtype), rows], dim=1)
        self.pipeline.eval_step(tokens, batch["labels"], target, **m.stage_inputs(batch))
        out, self._out = self._out, None
        return out

    @property
    def pipeline(self):
        """A forward-only schedule over the reference's chunks (the policy's under LoRA), built on
        first use like the module's own."""
        if self._pipeline is None:
            m = self.module
            self._pipeline = Pipeline(self.chunks, m._stages, m.ps, m.cfg.parallel.pipeline_schedule,
                                      m.derived.num_microbatches, self._record, m.home_device, stage_io=m._stage_io)
        return self._pipeline

    def _record(self, per_token_loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss function in the reference pass: the micro-batch's document sums
        written into its rows (the target's last column)."""
        s = per_token_loss.shape[1]
        m = self.module
        sums, _ = document_totals(per_token_loss.to(self._out.dtype), target[:, :s], target[:, s:2 * s],
                                  m.dpo.width, m.ps.cp_group)
        self._out[target[:, 2 * s].long()] = sums
        return sums.new_zeros(())


def _frozen_copy(module, device) -> List[nn.Module]:
    """The policy's chunks built anew (same stages, seed and shards: its initial weights), frozen;
    FSDP-sharded like the policy under ``parallel.data_parallel=fsdp``."""
    cfg, derived, ps = module.cfg, module.derived, module.ps
    if derived.pp > 1:
        chunks, _ = build_stage_chunks(cfg, derived, ps, device)
    else:
        chunks = [build_model(cfg, derived, ps, device)]
    for chunk in chunks:
        chunk.requires_grad_(False)
    if cfg.parallel.data_parallel == "fsdp":
        blocks = [[m for m in chunk.modules() if isinstance(m, Block)] for chunk in chunks]
        fsdp.shard_chunks(chunks, blocks, ps, derived.transformer.params_dtype, reshard_after_forward=True)
    return chunks
