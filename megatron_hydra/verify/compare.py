"""Two runs of the shrunk job compared: per-step losses and grad norms (rank 0's
``csv/metrics.csv``) and the weights each saved (layout-free checkpoints, read whole in one
process), as the largest relative difference and the first step and tensor beyond tolerance."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron_hydra.report import METRICS_CSV, read_metrics

METRICS = ("loss", "grad_norm")


@dataclass
class Difference:
    """The largest relative difference of two runs, and where they first differ beyond the
    tolerance: the first metric and, apart, the first tensor (None where they agree). Both are
    kept: a bug that scales gradients changes the first loss but, under Adam's normalised first
    update, the weights only a step later."""

    largest: float = 0.0
    first_metric: Optional[str] = None
    first_tensor: Optional[str] = None

    def add(self, other: "Difference") -> None:
        # NaN kept: ``max(0.0, nan)`` is 0.0, which would turn a NaN loss into agreement.
        nan = math.isnan(self.largest) or math.isnan(other.largest)
        self.largest = math.nan if nan else max(self.largest, other.largest)
        self.first_metric = self.first_metric or other.first_metric
        self.first_tensor = self.first_tensor or other.first_tensor

    def passes(self, tolerance: float) -> bool:
        """Nothing beyond ``tolerance`` recorded and the largest finite: a NaN compares false with
        everything, so ``largest <= tolerance`` alone cannot be the test."""
        return self.first is None and math.isfinite(self.largest) and self.largest <= tolerance

    @property
    def first(self) -> Optional[str]:
        return "; ".join(x for x in (self.first_tensor, self.first_metric) if x) or None


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: one number per tensor that a single bad element moves."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def metrics(run_dir: str) -> Dict[int, Dict[str, float]]:
    """Rank 0's logged loss and grad norm by optimizer step (1 for the first, as checkpoints are
    numbered; the log counts from 0)."""
    path = os.path.join(run_dir, METRICS_CSV)
    if not os.path.exists(path):  # a run that logged no step: every step is reported missing
        return {}
    return {int(r["step"]) + 1: {k: r[k] for k in METRICS if k in r} for r in read_metrics(path) if "loss" in r}


def checkpoint(run_dir: str, step: int) -> str:
    """The step's checkpoint of a verify run (``shrink.retarget`` puts them in ``run_dir/checkpoints``),
    named as the checkpoint store names it."""
    from megatron_hydra.checkpoint.store import step_dir

    return step_dir(os.path.join(run_dir, "checkpoints"), step)


def weights(path: str) -> List[Tuple[str, torch.Tensor]]:
    """Every model tensor of the checkpoint at ``path``, whole, in the order it was saved (the
    model's)."""
    from megatron_hydra.checkpoint.safe_reader import read_metadata
    from megatron_hydra.checkpoint.standalone import read_tensors, stored_entry

    metadata = read_metadata(path)
    keys = [k for k in metadata.state_dict_metadata if k.startswith("model/")]
    wanted = [(k, *stored_entry(path, metadata, k)) for k in keys]
    return list(read_tensors(path, wanted))


def compare_metrics(ours: Dict[int, Dict[str, float]], ref: Dict[int, Dict[str, float]], steps: List[int],
                    tolerance: float) -> Difference:
    out = Difference()
    for step in steps:
        for key in METRICS:
            if step not in ours or key not in ours[step]:
                out.add(Difference(float("inf"), first_metric=f"step {step}: {key} missing"))
                continue
            if step not in ref or key not in ref[step]:
                out.add(Difference(float("inf"), first_metric=f"step {step}: {key} missing in the reference"))
                continue
            a, b = ours[step][key], ref[step][key]
            rel = abs(a - b) / abs(b) if b else abs(a - b)
            out.add(Difference(rel, first_metric=f"step {step}: {key} {a!r} vs {b!r}" if not rel <= tolerance else None))
    return out


def compare_weights(ours: str, ref: str, step: int, tolerance: float) -> Difference:
    """The weights two runs saved at ``step``; the first tensor beyond ``tolerance`` named."""
    theirs = dict(weights(ref))
    out = Difference()
    for key, tensor in weights(ours):
        if key not in theirs:
            out.add(Difference(float("inf"), first_tensor=f"step {step}: tensor {key[len('model/'):]} missing in the reference"))
            continue
        rel = relative(tensor, theirs[key])
        out.add(Difference(rel, first_tensor=None if rel <= tolerance else
                           f"step {step}: tensor {key[len('model/'):]} differs by {rel:.2e}"))
    return out


def compare_runs(ours: str, ref: str, steps: List[int], tolerance: float) -> Difference:
    """Step by step, the weights saved at that step and its metrics."""
    out = Difference()
    mine, theirs = metrics(ours), metrics(ref)
    for step in steps:
        out.add(compare_weights(checkpoint(ours, step), checkpoint(ref, step), step, tolerance))
        out.add(compare_metrics(mine, theirs, [step], tolerance))
    return out
