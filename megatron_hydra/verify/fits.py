"""The fit check: the job's full-size dry run (``training.dry_run``: one real step on a fake
process group and fake GPU tensors) on its distinct rank positions, against one GPU's memory,
with the memory plan's columns beside it and, where a rank does not fit, the plan's fixes."""

from __future__ import annotations

import copy
import io
from contextlib import redirect_stdout
from typing import List, Tuple

from megatron_hydra.config import RunConfig, derive
from megatron_hydra.errors import ConfigError, one_line


def dry_run_config(job: RunConfig) -> Tuple[RunConfig, List[str]]:
    """The job as the dry run steps it (``training.dry_run.stand_in_config``), on GPUs: a CPU job
    is judged as the GPU job it stands for."""
    from megatron_hydra.training.dry_run import stand_in_config

    cfg, notes = copy.deepcopy(job), []
    if cfg.trainer.accelerator != "gpu":
        cfg.trainer.accelerator = "gpu"
        notes.append(f"judged on GPUs (trainer.accelerator=gpu) in the job's {cfg.precision.params_dtype}: its own "
                     "devices are CPU ranks (add trainer=gpu for the GPU job's bf16)")
    cfg, swaps = stand_in_config(cfg)
    return cfg, notes + swaps


def fits(job: RunConfig) -> Tuple[bool, str, List[str]]:
    """(fits, the dry run's table and verdict, notes); a rank that does not fit makes the last
    line the plan's one-line fixes."""
    from megatron_hydra.training.dry_run import check_fits, device_memory, dry_run, table

    cfg, notes = dry_run_config(job)
    derived = derive(cfg)
    device = device_memory(cfg)
    quiet = io.StringIO()
    with redirect_stdout(quiet):  # the simulated ranks' own output; the table below says it all
        results = dry_run(cfg, derived)
    text = table(cfg, derived, results, device)
    try:
        check_fits(derived, results, device)
    except ConfigError as e:
        return False, f"{text}\n{one_line(e)}", notes
    return True, text, notes
