"""The exactness and resume checks: the shrunk job trained at its layout on gloo ranks through the
launcher (the real step, Lightning loop and checkpoints), against the same job in one process;
then its step-K checkpoint resumed at another layout, against the layout run's next step."""

from __future__ import annotations

import copy
import os
import shutil
from typing import Optional, Tuple

from megatron_hydra.config import RunConfig, derive
from megatron_hydra.errors import ConfigError, MegatronHydraError, one_line
from megatron_hydra.verify.compare import Difference, checkpoint, compare_runs
from megatron_hydra.verify.report import describe
from megatron_hydra.verify.shrink import Shrunk, retarget, single_process


def train(cfg: RunConfig) -> Optional[str]:
    """One run through the launcher; its one-line failure, or None."""
    from megatron_hydra.launcher import run

    try:
        run(cfg)
    except MegatronHydraError as e:
        return one_line(e)
    return None


def layout_name(cfg: RunConfig) -> str:
    return describe(derive(cfg)) + (" sp" if cfg.parallel.sequence_parallel else "")


def exact(shrunk: Shrunk, root: str, steps: int, tolerance: float, extra: int,
          with_reference: bool = True) -> Tuple[Difference, Optional[str]]:
    """The layout run (``steps + extra`` steps, saving each) against one process (``steps``);
    the layout run's directory, None where it failed."""
    layout = copy.deepcopy(shrunk.cfg)
    layout.trainer.max_steps = steps + extra
    retarget(layout, os.path.join(root, "layout"))
    failed = train(layout)
    if failed is not None:
        return Difference(float("inf"), first_metric=f"the run at {layout_name(layout)} failed: {failed}"), None
    if not with_reference:
        return Difference(), layout.run_dir
    ref = single_process(shrunk.cfg, os.path.join(root, "single"), steps)
    failed = train(ref)
    if failed is not None:
        return Difference(float("inf"), first_metric=f"the run in one process failed: {failed}"), layout.run_dir
    return compare_runs(layout.run_dir, ref.run_dir, list(range(1, steps + 1)), tolerance), layout.run_dir


def resume_layout(cfg: RunConfig, max_ranks: int) -> Optional[RunConfig]:
    """Another layout for the resumed step: one process where the job has several ranks, else tp2
    (the same global batch); None where neither differs within ``max_ranks``."""
    if derive(cfg).world_size > 1:
        return single_process(cfg, cfg.run_dir, cfg.trainer.max_steps)
    if max_ranks < 2:
        return None
    other = copy.deepcopy(cfg)
    other.parallel.tensor_parallel_size, other.trainer.devices = 2, 2
    try:
        derive(other)
    except ConfigError:  # heads or groups that do not split in two (a single query group)
        return None
    return other


def resume(shrunk: Shrunk, layout_dir: str, root: str, steps: int, tolerance: float,
           max_ranks: int) -> Tuple[Optional[Difference], str]:
    """Step ``steps`` of the layout run resumed at another layout for one step, against the layout
    run's own next step (losses, grad norm, weights); None and why where no other layout fits."""
    cfg = copy.deepcopy(shrunk.cfg)
    cfg.trainer.max_steps = steps + 1
    other = resume_layout(cfg, max_ranks)
    if other is None:
        return None, "the job runs in one process and tp2 does not fit it or verify.max_ranks"
    run_dir = os.path.join(root, "resume")
    retarget(other, run_dir)
    other.trainer.max_steps, other.checkpoint.resume = steps + 1, "auto"
    os.makedirs(other.checkpoint.dir, exist_ok=True)
    shutil.copytree(checkpoint(layout_dir, steps), checkpoint(run_dir, steps))
    name = layout_name(other)
    failed = train(other)
    if failed is not None:
        return Difference(float("inf"), first_metric=f"the resumed run at {name} failed: {failed}"), name
    return compare_runs(run_dir, layout_dir, [steps + 1], tolerance), name
