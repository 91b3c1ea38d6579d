"""The run's loggers (``trainer.logger``), and its metric history, ``csv/metrics.csv`` and
TensorBoard events, continued across resumes.

A preempted run resumes from its last checkpoint at step ``k`` into the same run directory.
Lightning's ``CSVLogger`` deletes ``metrics.csv`` when it opens it, so after a few preemptions
only the last run's steps would remain; its ``TensorBoardLogger`` keeps the old event files, so
the steps the killed run logged after its checkpoint would show twice. Here both keep the
history of the steps before ``k`` and drop the rest, which the resumed run logs again: every
step is in the history exactly once. A fresh start (``k = 0``) in a reused directory therefore
starts an empty history.

- CSV: the rows of steps ``>= k`` and a torn last row (a process killed mid-write) are dropped,
  and the file is rewritten under a temporary name and renamed into place, as is every later
  rewrite for a new column; rows are then appended as Lightning logs them.
- TensorBoard: SummaryWriter's ``purge_step=k`` starts the new event file with a restart marker,
  and TensorBoard's readers discard the earlier files' events at steps ``>= k``.
"""

from __future__ import annotations

import csv
import io
import os
from typing import List, Optional

from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment

from megatron_hydra.config import RunConfig


def build_loggers(cfg: RunConfig, start_step: int, rank: int) -> list:
    """The loggers ``trainer.logger`` names, writing into the run dir, for a run that starts at
    ``start_step``. W&B's is built on rank 0 only (``training.wandb_logger``); the others write on
    rank 0 only by themselves."""
    run_dir, loggers = cfg.run_dir, []
    for name in cfg.trainer.logger:
        if name == "tensorboard":
            loggers.append(TensorBoardLogger(run_dir, name="", version="tensorboard", default_hp_metric=False,
                                             purge_step=start_step))
        elif name == "csv":
            loggers.append(HistoryCSVLogger(run_dir, start_step))
        elif name == "wandb" and rank == 0:
            from megatron_hydra.training.wandb_logger import build_wandb_logger

            loggers.append(build_wandb_logger(cfg))
    return loggers


def _write_atomically(path: str, rows: List[List[str]]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    os.replace(tmp, path)


def _step(value: str) -> Optional[int]:
    try:
        return int(float(value))
    except ValueError:
        return None


def keep_history(path: str, start_step: int) -> List[str]:
    """Rewrite the CSV at ``path`` keeping only the complete rows of steps before ``start_step``;
    returns its header (empty when there is no usable file, which is then removed)."""
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as f:
        text = f.read()
    text = text[:text.rfind("\n") + 1]  # a row without its line end was torn by a kill
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or "step" not in rows[0]:
        os.remove(path)
        return []
    header, col = rows[0], rows[0].index("step")
    kept = [r for r in rows[1:] if len(r) == len(header) and (_step(r[col]) is not None)
            and _step(r[col]) < start_step]
    _write_atomically(path, [header, *kept])
    return header


class _HistoryWriter(ExperimentWriter):
    """Lightning's CSV writer, but opening an existing file keeps its history (see the module)."""

    def __init__(self, log_dir: str, start_step: int):
        self._start_step = start_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        # Lightning's writer deletes metrics.csv here; this is where the history is kept instead.
        self.metrics_keys = keep_history(self.metrics_file_path, self._start_step)

    def _rewrite_with_new_header(self, fieldnames: List[str]) -> None:
        with open(self.metrics_file_path, newline="") as f:
            old = list(csv.DictReader(f))
        rows = [[row.get(k) or "" for k in fieldnames] for row in old]
        _write_atomically(self.metrics_file_path, [fieldnames, *rows])


class HistoryCSVLogger(CSVLogger):
    """``csv/metrics.csv`` of the run directory, continued from ``start_step`` (rank 0 writes)."""

    def __init__(self, run_dir: str, start_step: int):
        super().__init__(run_dir, name="", version="csv")
        self._start_step = start_step

    @property
    @rank_zero_experiment
    def experiment(self) -> _HistoryWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _HistoryWriter(self.log_dir, self._start_step)
        return self._experiment
