"""Megatron-LM checkpoints in and out: ``from_megatron`` and ``to_megatron``.

``from_megatron`` reads a checkpoint Megatron-LM saved, in either of its formats, at any tensor
and pipeline parallel size: ``torch_dist`` (``megatron_dist``) or the legacy per-rank files
(``megatron_legacy``). ``input`` is the directory Megatron-LM saved into (its ``--save``: the
iteration comes from ``latest_checkpointed_iteration.txt``, or ``iteration=``) or one iteration's
directory. The model config comes from the arguments saved with it (``megatron_args``), the
tensors' names and layouts from ``megatron_names``.

The result is one of our checkpoints, layout-free (any ``parallel=`` loads it), written one
tensor at a time. Where the source holds Adam's state in model space (``torch_dist``: the plain
optimizer, or the distributed optimizer saved ``fully_reshardable``), its moments and fp32 main
weights go into our optimizer entries (``optim/<name>/exp_avg``, ``exp_avg_sq``, ``step``;
``main/<name>``) and the checkpoint records Megatron's iteration and consumed samples, so a run
loading it resumes where Megatron stopped, with its moments. Otherwise the weights alone are
written (step 0) and the result says why: the run starts its optimizer afresh
(``checkpoint.load_optimizer=false``). Either way the printed command carries the optimizer,
schedule, batch and precision settings the arguments record (``megatron_args.training``).

Every model tensor of the source must be read by one of ours (``megatron_names.ignorable`` lists
what may be left): a leftover one is a feature the arguments did not reveal, refused in one line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from megatron_hydra import untrusted
from megatron_hydra.checkpoint import plan, standalone
from megatron_hydra.checkpoint.lazy_write import LazyTensor
from megatron_hydra.config import RunConfig
from megatron_hydra.convert import megatron_dist, megatron_legacy, staging
from megatron_hydra.convert.api import check_layout, check_output, composed_config, default_name, fine_tune_command
from megatron_hydra.convert.megatron_args import model_of, training
from megatron_hydra.convert.megatron_export import to_megatron
from megatron_hydra.convert.megatron_names import Part, parts
from megatron_hydra.errors import CheckpointError, ConfigError

__all__ = ["from_megatron", "to_megatron", "locate", "Imported"]

LATEST = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^iter_(\d{7})$")


@dataclass
class Imported:
    """What ``from_megatron`` did: the command continuing from it, and what the user should know."""

    source: str
    command: str
    optimizer: bool
    notes: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"imported {self.source}", *(f"note: {n}" for n in self.notes)]
        return "\n".join([*lines, "continue from it with:", f"  {self.command}"])


def locate(input: str, iteration: Optional[int] = None) -> str:
    """The iteration directory of ``input``: ``input`` itself when it is one, else its
    ``iter_NNNNNNN`` (``iteration``, or the one ``latest_checkpointed_iteration.txt`` names)."""
    if not os.path.isdir(input):
        raise ConfigError(f"input={input}: no such directory; give Megatron-LM's --save directory or one of its "
                          "iter_NNNNNNN directories")
    if megatron_dist.is_dist(input) or megatron_legacy.is_legacy(input):
        return input
    if iteration is None:
        latest = os.path.join(input, LATEST)
        if not os.path.lexists(latest):
            found = sorted(n for n in os.listdir(input) if ITER_DIR.match(n))
            hint = f" (it holds {', '.join(found[-3:])}: give iteration=N)" if found else ""
            raise CheckpointError(f"input={input} has no {LATEST} and is no Megatron checkpoint directory{hint}")
        text = untrusted.read_text(latest, 64, "Megatron iteration file", CheckpointError).strip()
        if text == "release":
            return _iteration_dir(input, "release")
        if not text.isdigit():
            raise CheckpointError(f"{latest}: holds {text[:40]!r}, not an iteration number: the file is damaged")
        iteration = int(text)
    if not isinstance(iteration, int) or iteration < 0:
        raise ConfigError(f"iteration={iteration}: give a non-negative iteration number")
    return _iteration_dir(input, f"iter_{iteration:07d}")


def _iteration_dir(input: str, name: str) -> str:
    path = os.path.join(input, name)
    if os.path.islink(path) or not os.path.isdir(path):
        found = sorted(n for n in os.listdir(input) if ITER_DIR.match(n))
        raise CheckpointError(f"{path}: no such checkpoint directory (found: {', '.join(found[-3:]) or 'none'})")
    if not (megatron_dist.is_dist(path) or megatron_legacy.is_legacy(path)):
        raise CheckpointError(f"{path}: neither a torch_dist checkpoint (metadata.json, .metadata) nor legacy "
                              "mp_rank_* files: not a Megatron-LM checkpoint")
    return path


def _iteration(value, path: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise CheckpointError(f"{path}: its 'iteration' is {str(value)[:40]}, not an iteration number: refused")


@dataclass
class _Source:
    """An opened Megatron checkpoint: its arguments (and the file holding them), how to read our
    tensors from it, and whether its optimizer state maps onto ours (``main``: None when not,
    ``why`` saying why; else the kind of its fp32 main weights, '' for none)."""

    kind: str
    ck: object
    args: object
    args_file: str
    iteration: object
    main: Optional[str]
    why: str

    def read(self, part: Part, shape) -> torch.Tensor:
        if self.kind == "torch_dist":
            return megatron_dist.read_part(self.ck, part, shape)
        return self.ck.read(part, list(shape))

    def dtype(self, part: Part, shape) -> torch.dtype:
        if self.kind == "torch_dist":
            return self.ck.dtype(megatron_dist.region(self.ck, part, shape)[0])
        return self.ck.dtype(part)

    def check_all_read(self, places: Dict[str, Part], tied: bool) -> None:
        """Every model tensor of the source is read by one of ``places`` (the ignorable aside)."""
        wanted = list(places.values())
        if self.kind == "torch_dist":
            left = megatron_dist.unused(self.ck, wanted, tied)
        else:
            left = self.ck.unused(wanted, tied)
        if left:
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise CheckpointError(f"{self.ck.path}: holds {left[0]}{more}, which no tensor of the model its arguments "
                                  "describe reads: a feature this import does not map; refused rather than dropped")


def _open(path: str) -> _Source:
    if megatron_dist.is_dist(path):
        ck = megatron_dist.open_dist(path)
        main, why = megatron_dist.optimizer_layout(ck)
        return _Source("torch_dist", ck, ck.common.get("args"), os.path.join(path, megatron_dist.COMMON),
                       ck.common.get("iteration", 0), main, why)
    ck = megatron_legacy.open_legacy(path)
    why = megatron_legacy.OPTIMIZER_NOT_CARRIED if ck.has_optimizer else "it holds no optimizer state"
    return _Source("legacy", ck, ck.first.get("args"), ck.first_file, ck.first.get("iteration", 0), None, why)


def _model_tensors(source: _Source, places: Dict[str, Part], shapes) -> Dict[str, LazyTensor]:
    """Our logical tensors, each read from the source when the writer reaches it."""
    return {name: LazyTensor(tuple(shapes[name]), source.dtype(part, shapes[name]),
                             lambda part=part, shape=shapes[name]: source.read(part, shape))
            for name, part in places.items()}


def _state(ck, part: Part, shape, kind: str) -> LazyTensor:
    """One optimizer state tensor (``kind``: exp_avg, fp32_param, ...) of ``part``, read when written."""
    prefix = f"{megatron_dist.STATE_PREFIX}{kind}."
    key = megatron_dist.region(ck, part, shape, prefix)[0]
    return LazyTensor(tuple(shape), ck.dtype(key), lambda: megatron_dist.read_part(ck, part, shape, prefix))


def _optimizer_tensors(source: _Source, places: Dict[str, Part], shapes, step: int,
                       model: Dict[str, LazyTensor]) -> Dict[str, LazyTensor]:
    """Our optimizer entries from ``torch_dist``'s model-space state; a 16-bit model keeps its fp32
    main weights as ``main/<name>`` (an fp32 model's are its weights)."""
    out = {}
    for name, part in places.items():
        for kind in ("exp_avg", "exp_avg_sq"):
            out[f"optim/{name}/{kind}"] = _state(source.ck, part, shapes[name], kind)
        out[f"optim/{name}/step"] = LazyTensor((), torch.float32, lambda: torch.tensor(float(step)))
        if source.main and model[name].dtype != torch.float32:
            out[f"main/{name}"] = _state(source.ck, part, shapes[name], source.main)
    return out


def _save(stage: str, source: _Source, cfg: RunConfig, derived, places, shapes, iteration: int) -> str:
    """Write the checkpoint into ``stage``; returns the note on the optimizer state."""
    model = _model_tensors(source, places, shapes)
    if source.main is None:
        standalone.save_tensors(stage, model, cfg, derived)
        return f"optimizer state not carried: {source.why}; a run loading it starts its optimizer afresh"
    step = megatron_dist.optimizer_step(source.ck.common)
    consumed = getattr(source.args, "consumed_train_samples", 0)
    standalone.save_tensors(stage, model, cfg, derived,
                            optimizer=_optimizer_tensors(source, places, shapes, step, model), step=iteration,
                            consumed_samples=consumed if isinstance(consumed, int) else 0)
    return f"optimizer state carried (Adam step {step}); a run loading it resumes at iteration {iteration}"


def from_megatron(input: str, output: str, parallel: str = "single", name: Optional[str] = None,
                  iteration: Optional[int] = None) -> Imported:
    """Import the Megatron-LM checkpoint ``input`` into our checkpoint at ``output``; ``parallel``
    checks that the model splits that way and goes into the command continuing from it."""
    check_output(output)
    path = locate(input, iteration)
    source = _open(path)
    done = _iteration(source.iteration, path)
    found = model_of(source.args, source.args_file, name or default_name(_named_dir(path)))
    overrides, notes = training(source.args, source.args_file)
    composed = composed_config(parallel, "gpt")
    cfg = RunConfig(model=found.model, parallel=composed.parallel, run_dir="unused")
    check_layout(cfg)
    cfg, derived = standalone.single_process(cfg)
    cfg.parallel = composed.parallel  # the intended layout, recorded; loading ignores it
    shapes = plan.logical_shapes(derived)
    places = parts(list(shapes), cfg.model.activation == "swiglu")
    source.check_all_read(places, cfg.model.tie_embeddings)
    with staging.staged(output) as stage:
        notes = [*found.notes, *notes, _save(stage, source, cfg, derived, places, shapes, done)]
    carried = source.main is not None
    if carried and overrides.get("trainer.max_steps", 0) <= done:
        notes.append(f"set trainer.max_steps above {done}, the iteration the run resumes at")
    command = " ".join([fine_tune_command(cfg, output, parallel, load_optimizer=carried),
                        *(f"{key}={value}" for key, value in overrides.items())])
    where = f"{source.kind}, iteration {done}, tp{found.tp} x pp{found.pp}"
    return Imported(f"{input} ({where}) -> {output}", command, carried, notes)


def _named_dir(path: str) -> str:
    """The directory a checkpoint is named after: the iteration directory's parent (Megatron-LM's
    ``--save``) when the iteration directory has Megatron's own name."""
    path = os.path.normpath(os.path.abspath(path))
    base = os.path.basename(path)
    return os.path.dirname(path) if ITER_DIR.match(base) or base == "release" else path
