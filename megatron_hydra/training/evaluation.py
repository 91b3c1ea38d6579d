"""Evaluations during training (``trainer.eval``): lm-evaluation-harness tasks on the live model.

Every ``trainer.eval.every_n_steps`` optimizer steps (never when ``trainer.eval.tasks`` is empty or
the interval is 0), every rank enters the evaluation at the same step boundary, the end of the
step, and runs the adapter's ``evaluate`` over an ``inference.engine.Engine`` built on this rank's
live model chunks and the job's ``ParallelState``: the job's own layout and process groups, no
second launch, no copy of the weights. The engine's collectives need every rank, which is why the
step is a function of the step count alone.

Rank 0 logs each task's numeric metrics as ``eval/<task>/<metric>`` to every logger at the step
just trained (the row of that step's loss): lm-eval's ``acc,none`` becomes ``acc``, a filtered
``exact_match,strict-match`` becomes ``exact_match/strict-match``. lm-eval's results JSON of each
evaluation goes to ``<trainer.eval.output or run_dir/eval>/step_<N>/``.

Training goes on as if nothing had happened. lm-eval reseeds Python's, numpy's and torch's
generators, and the engine switches the model to eval mode: both the generator states
(``checkpoint.rng``, the same capture a checkpoint saves) and every module's mode are put back, so
the losses after an evaluation equal those of a run without one. The evaluation's time is left
out of the throughput window.

A failed evaluation does not end the run. Each rank catches its own exception, then the ranks
exchange their one-line errors on a process group of their own (created when training starts, so
that the exchange can never be matched with a collective the evaluation left half done), and all
go on: rank 0 warns ``eval at step N failed: <line>; training goes on``. The limit: an exception on
some ranks only, raised while the others wait inside one of the evaluation's collectives, holds
those others until ``trainer.collective_timeout_s``; they then fail too, and the ranks agree, but
a collective that timed out leaves its process group unusable (gloo closes the connections, NCCL
aborts the process), so the run then ends at its next collective, with an error instead of a
hang. Failures every rank meets alike (a task's data file gone, lm-eval raising on a task) are the
common case and leave the groups intact. A stop request (``trainer.should_stop``, agreed on every
rank) skips the evaluation: the save and stop come first.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Dict, Iterator, List, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from megatron_hydra.checkpoint import rng
from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.config.inference import eval_output_dir, evaluating_during_training
from megatron_hydra.errors import MegatronHydraError, one_line
from megatron_hydra.parallel.state import ParallelState

log = logging.getLogger("megatron_hydra")


def evaluation_callbacks(cfg: RunConfig, derived: Derived, ps: ParallelState) -> list:
    """The evaluation callback when ``trainer.eval`` asks for one, else none."""
    return [EvalCallback(cfg, derived, ps)] if evaluating_during_training(cfg) else []


def metric_name(key: str) -> str:
    """lm-eval's ``<metric>,<filter>`` as a logger's name: the filter dropped when it is ``none``."""
    metric, _, filt = key.partition(",")
    return metric if filt == "none" else f"{metric}/{filt}"


def eval_metrics(results: Dict[str, Dict[str, object]]) -> Dict[str, float]:
    """``{task: {metric: value}}`` as ``{eval/<task>/<metric>: number}``. Only lm-eval's metrics
    (its ``<metric>,<filter>`` keys) that are numbers: not its bookkeeping (``sample_len``,
    ``alias``), nor an ``N/A`` standard error."""
    out = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if "," in key and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"eval/{task}/{metric_name(key)}"] = float(value)
    return out


@contextmanager
def training_state_kept(model: torch.nn.Module) -> Iterator[None]:
    """Whatever runs inside leaves the random generators and every module's train/eval mode as
    they were, so that training continues with the draws and the dropout it would have had."""
    states = rng.capture()
    modes = [(m, m.training) for m in model.modules()]
    grad = torch.is_grad_enabled()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
        torch.set_grad_enabled(grad)
        rng.restore(states)


class EvalCallback(pl.Callback):
    """At the end of every ``every_n_steps``-th optimizer step: evaluate, log, restore (the module
    docstring). A callback, because the step boundary, the live model and the loggers are all
    there, and the step itself stays the training's alone."""

    def __init__(self, cfg: RunConfig, derived: Derived, ps: ParallelState):
        self.cfg, self.derived, self.ps = cfg, derived, ps
        self.every = cfg.trainer.eval.every_n_steps
        self._tokenizer = None
        self._group = None  # where the ranks exchange their errors (see the module docstring)
        self.failures: List[int] = []  # the steps whose evaluation failed

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:  # collective: every rank, here
            self._group = dist.new_group(backend="gloo",
                                         timeout=timedelta(seconds=self.cfg.trainer.collective_timeout_s))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # optimizer steps done, the same on every rank
        if step % self.every == 0 and not trainer.should_stop:
            self.run(trainer, pl_module, step)

    def run(self, trainer: pl.Trainer, pl_module, step: int) -> Optional[Dict[str, float]]:
        """Evaluate after ``step`` steps; the logged metrics, or None when the evaluation failed."""
        start = time.perf_counter()
        metrics, error = None, None
        with training_state_kept(pl_module.model):
            try:
                metrics = eval_metrics(self._evaluate(pl_module, step))
            except Exception as exc:  # noqa: BLE001 - any failure is one line; training goes on
                error = one_line(exc)
                if not isinstance(exc, MegatronHydraError):
                    error = f"{type(exc).__name__}: {error}"
        error = self._agree(error)
        if error is not None:
            self.failures.append(step)
            if self.ps.rank == 0:
                log.warning("eval at step %d failed: %s; training goes on", step, error)
        elif self.ps.rank == 0:
            self._log(trainer, step, metrics)
        _leave_out_of_throughput(pl_module, time.perf_counter() - start)
        return metrics if error is None else None

    def _evaluate(self, pl_module, step: int) -> Dict[str, Dict[str, float]]:
        """lm-eval over an engine on the live chunks (built anew each time: it holds no copy of
        weights that training has since changed)."""
        from megatron_hydra.data.builders import build_tokenizer_for
        from megatron_hydra.inference import lm_eval_adapter
        from megatron_hydra.inference.engine import Engine, model_positions

        e, tcfg = self.cfg.trainer.eval, self.derived.transformer
        chunks = list(pl_module.model) if self.derived.pp > 1 else [pl_module.model]
        engine = Engine(chunks, self.ps, tcfg, batch_size=e.batch_size)
        if self._tokenizer is None:
            self._tokenizer = build_tokenizer_for(self.cfg.data)
        write_to = os.path.join(eval_output_dir(self.cfg), f"step_{step:07d}")
        return lm_eval_adapter.evaluate(engine, self._tokenizer, model_positions(tcfg), e, write_to)

    def _agree(self, error: Optional[str]) -> Optional[str]:
        """Every rank's error (None: it succeeded), exchanged; the first failing rank's line, named
        by rank unless every rank failed alike. The same answer on every rank."""
        if self._group is None:
            return error
        errors: List[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error, group=self._group)
        failed = [(rank, line) for rank, line in enumerate(errors) if line is not None]
        if not failed:
            return None
        rank, line = failed[0]
        return line if all(other == line for other in errors) else f"rank {rank}: {line}"

    def _log(self, trainer: pl.Trainer, step: int, metrics: Dict[str, float]) -> None:
        """Rank 0: to every logger, at the row of the step just trained (``step - 1``, counted from 0
        like the loss), flushed as the module's step metrics are."""
        if not metrics:
            return
        for logger in trainer.loggers:
            logger.log_metrics({**metrics, "epoch": trainer.current_epoch}, step=step - 1)
            logger.save()
        log.info("eval at step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))


def _leave_out_of_throughput(pl_module, seconds: float) -> None:
    """Move the module's throughput window (``LMModule._window_start``) past the evaluation, so the
    next logged tokens/s counts training only, over all its steps since the last logging step."""
    if getattr(pl_module, "_window_start", None) is not None:
        pl_module._window_start += seconds
