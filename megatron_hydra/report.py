"""Plots and a summary table of a run or a sweep: ``python -m megatron_hydra.report DIR [--out OUT]``.

``DIR`` is one run's directory (it holds ``csv/metrics.csv``) or a multirun directory (one job
directory per run, ``0/``, ``1/``, ..., each with its ``csv/metrics.csv``). Into ``OUT`` (default
``DIR/report``) go

- ``loss.png``: training loss (line) and validation loss (dots) against tokens trained, one
  colour per job;
- ``throughput.png``: tokens/s and MFU against the step;
- ``eval.png`` (when the run evaluated during training, ``trainer.eval``): one panel per
  ``eval/<task>/<metric>``, against tokens trained (against the step when an evaluation fell on a
  step that logged no token count), with lm-eval's standard error as error bars;
- ``summary.md``: a table of each job's final metrics, best first by final validation loss (by
  final training loss when the jobs did not validate), also printed.

A job is labelled by the overrides that differ between the jobs (``.hydra/overrides.yaml``, as
Hydra saved them), or else by the keys of ``resolved_config.yaml`` that differ; a single run by
its directory name. Tokens are ``consumed_samples x model.seq_length``. Needs matplotlib
(``pip install '.[report]'``). A path that holds no run is one line, exit status 2.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import yaml

from megatron_hydra.errors import DataError

METRICS_CSV = os.path.join("csv", "metrics.csv")
# Keys that differ between any two jobs without being what the sweep varied.
_PER_JOB_KEYS = ("run_dir", "checkpoint.dir", "hydra.run.dir", "hydra.sweep.dir", "hydra.job.num")
# A label names at most this many differing keys (runs that are not one sweep differ in many).
MAX_LABEL_KEYS = 4


@dataclass
class Job:
    path: str
    rows: List[Dict[str, float]]
    label: str = ""

    def series(self, key: str) -> List[Dict[str, float]]:
        return [r for r in self.rows if key in r and "step" in r]

    def last(self, key: str) -> Optional[float]:
        rows = self.series(key)
        return rows[-1][key] if rows else None


def read_metrics(path: str) -> List[Dict[str, float]]:
    """The rows of a ``metrics.csv``, each with the columns it has a number in."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            values = {}
            for key, value in row.items():
                try:
                    values[key] = float(value)
                except (TypeError, ValueError):
                    pass
            rows.append(values)
    return rows


def find_jobs(path: str) -> List[str]:
    """``path`` itself when it is a run, else its job directories (numbered ones in order)."""
    if not os.path.isdir(path):
        raise DataError(f"{path}: no such directory: give a run dir (with {METRICS_CSV}) or a multirun dir")
    if os.path.isfile(os.path.join(path, METRICS_CSV)):
        return [path]
    names = [n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n, METRICS_CSV))]
    if not names:
        raise DataError(f"{path}: holds no run: neither {METRICS_CSV} nor job directories with one "
                        "(give the run dir, or the multirun dir holding 0/, 1/, ...)")
    names.sort(key=lambda n: (0, int(n), "") if n.isdigit() else (1, 0, n))
    return [os.path.join(path, n) for n in names]


def _load_yaml(path: str):
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None


def _flatten(node, prefix: str = "") -> Dict[str, str]:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: str(node)}


def _overrides(job: str) -> Optional[Dict[str, str]]:
    items = _load_yaml(os.path.join(job, ".hydra", "overrides.yaml"))
    if not isinstance(items, list):
        return None
    return dict(str(item).split("=", 1) if "=" in str(item) else (str(item), "") for item in items)


def _differing(settings: Sequence[Dict[str, str]]) -> List[str]:
    keys = sorted({k for s in settings for k in s} - set(_PER_JOB_KEYS))
    return [k for k in keys if len({s.get(k) for s in settings}) > 1]


def labels(jobs: Sequence[str]) -> List[str]:
    """What tells the jobs apart: differing Hydra overrides, else differing resolved config keys."""
    if len(jobs) == 1:
        return [os.path.basename(os.path.normpath(jobs[0]))]
    for read in (_overrides, lambda j: _flatten(_load_yaml(os.path.join(j, "resolved_config.yaml")) or {})):
        settings = [read(j) for j in jobs]
        if all(s is not None for s in settings):
            keys = _differing(settings)
            if keys:
                more = f" (+{len(keys) - MAX_LABEL_KEYS} more)" if len(keys) > MAX_LABEL_KEYS else ""
                return [" ".join(f"{k}={s.get(k, '-')}" for k in keys[:MAX_LABEL_KEYS]) + more for s in settings]
    return [os.path.basename(os.path.normpath(j)) for j in jobs]


def _seq_length(job: str) -> Optional[int]:
    cfg = _load_yaml(os.path.join(job, "resolved_config.yaml"))
    try:
        return int(cfg["model"]["seq_length"])
    except (TypeError, KeyError, ValueError):
        return None


def tokens_by_step(job: Job) -> Dict[float, float]:
    """Tokens trained after each logged step (validation rows share their step's count)."""
    seq = _seq_length(job.path)
    if seq is None:
        return {}
    return {r["step"]: r["consumed_samples"] * seq for r in job.series("consumed_samples")}


def summary(job: Job) -> Dict[str, Optional[float]]:
    """Final loss and validation loss, steps and tokens trained, median tokens/s and MFU over the
    logged steps (the median, so that the slow first steps do not weigh), the largest peak memory."""

    def median(key):
        values = [r[key] for r in job.series(key)]
        return statistics.median(values) if values else None

    peaks = [r["peak_memory_gib"] for r in job.series("peak_memory_gib")]
    tokens = tokens_by_step(job)
    losses = job.series("loss")
    return {"steps": int(losses[-1]["step"]) + 1 if losses else None, "tokens": max(tokens.values()) if tokens else None,
            "loss": job.last("loss"), "val_loss": job.last("val_loss"), "tokens_per_s": median("tokens_per_s"),
            "mfu": median("mfu"), "peak_memory_gib": max(peaks) if peaks else None}


COLUMNS = (("loss", "final loss", "{:.4f}"), ("val_loss", "final val_loss", "{:.4f}"), ("steps", "steps", "{:d}"),
           ("tokens", "tokens", "{:.0f}"), ("tokens_per_s", "tokens/s (median)", "{:.1f}"),
           ("mfu", "MFU % (median)", "{:.2f}"), ("peak_memory_gib", "peak memory GiB", "{:.3f}"))


def ranked(jobs: Sequence[Job]) -> List[Job]:
    """Best first: by final validation loss when every job has one, else by final training loss."""
    key = "val_loss" if all(j.last("val_loss") is not None for j in jobs) else "loss"

    def order(job):
        value = job.last(key)
        return math.inf if value is None or math.isnan(value) else value

    return sorted(jobs, key=order)


def table(jobs: Sequence[Job]) -> str:
    lines = ["| rank | job | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for i, job in enumerate(ranked(jobs), 1):
        values = summary(job)
        cells = ["" if values[k] is None else fmt.format(values[k]) for k, _, fmt in COLUMNS]
        name = os.path.basename(os.path.normpath(job.path))
        label = job.label if job.label != name else ""
        lines.append(f"| {i} | {name}{' ' + label if label else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise DataError("the report draws with matplotlib, which is not installed: pip install '.[report]' "
                        "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(jobs: Sequence[Job], out: str) -> List[str]:
    plt = _pyplot()
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, job in enumerate(jobs):
        colour, tokens = colours[i % len(colours)], tokens_by_step(job)
        for key, style in (("loss", dict(linestyle="-")), ("val_loss", dict(linestyle="--", marker="o"))):
            rows = [r for r in job.series(key) if r["step"] in tokens]
            if rows:
                ax.plot([tokens[r["step"]] for r in rows], [r[key] for r in rows], color=colour,
                        label=f"{job.label} ({'validation' if key == 'val_loss' else 'train'})", **style)
    ax.set(xlabel="tokens", ylabel="loss", title="loss against tokens")
    ax.legend(fontsize="small")
    paths = [os.path.join(out, "loss.png")]
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    fig, axes = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for ax, key, title in ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "mfu", "MFU (% of peak)")):
        for i, job in enumerate(jobs):
            rows = job.series(key)
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], color=colours[i % len(colours)],
                    label=job.label)
        ax.set(ylabel=title)
        ax.legend(fontsize="small")
    axes[1].set(xlabel="step")
    paths.append(os.path.join(out, "throughput.png"))
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    keys = eval_keys(jobs)
    if keys:
        paths.append(os.path.join(out, "eval.png"))
        _plot_evals(plt, jobs, colours, keys, paths[-1])
    return paths


def _is_stderr(key: str) -> bool:
    parts = key.split("/")
    return len(parts) > 2 and parts[2].endswith("_stderr")


def stderr_key(key: str) -> str:
    """The standard error's column of ``eval/<task>/<metric>[/<filter>]``: lm-eval names it
    ``<metric>_stderr`` under the same filter."""
    parts = key.split("/")
    parts[2] += "_stderr"
    return "/".join(parts)


def eval_keys(jobs: Sequence[Job]) -> List[str]:
    """The ``eval/<task>/<metric>`` columns any job logged (standard errors aside: error bars)."""
    return sorted({k for job in jobs for r in job.rows for k in r if k.startswith("eval/") and not _is_stderr(k)})


def eval_series(job: Job, key: str, tokens: Optional[Dict[float, float]]) -> List[tuple]:
    """(x, value, standard error or None) per evaluation of ``key``; x is tokens trained when
    ``tokens`` is given, else the step."""
    err = stderr_key(key)
    return [(tokens[r["step"]] if tokens is not None else r["step"], r[key], r.get(err)) for r in job.series(key)]


def _plot_evals(plt, jobs: Sequence[Job], colours, keys: List[str], path: str) -> None:
    by_tokens = {id(job): tokens_by_step(job) for job in jobs}
    use_tokens = all(r["step"] in by_tokens[id(job)] for job in jobs for key in keys for r in job.series(key))
    cols = min(2, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.5 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for i, job in enumerate(jobs):
            points = eval_series(job, key, by_tokens[id(job)] if use_tokens else None)
            if points:
                errors = [e if e is not None and math.isfinite(e) else 0.0 for _, _, e in points]
                ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=errors, marker="o", capsize=3,
                            color=colours[i % len(colours)], label=job.label)
        ax.set(title=key.removeprefix("eval/"), xlabel="tokens" if use_tokens else "step")
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def report(path: str, out: Optional[str] = None) -> List[str]:
    """Write the plots and ``summary.md`` of the run or sweep at ``path``; returns their paths."""
    dirs = find_jobs(path)
    jobs = [Job(d, read_metrics(os.path.join(d, METRICS_CSV)), label) for d, label in zip(dirs, labels(dirs))]
    out = out or os.path.join(path, "report")
    _pyplot()  # a missing matplotlib stops here, before anything is written
    os.makedirs(out, exist_ok=True)
    paths = plot(jobs, out)
    text = table(jobs)
    paths.append(os.path.join(out, "summary.md"))
    with open(paths[-1], "w") as f:
        f.write(text)
    print(text, end="")
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_hydra.report", description=__doc__.split("\n")[0])
    parser.add_argument("path", help="a run dir (with csv/metrics.csv) or a multirun dir (one such dir per job)")
    parser.add_argument("--out", help="where the plots and summary.md go (default: PATH/report)")
    args = parser.parse_args(argv)
    try:
        for written in report(args.path, args.out):
            print(f"wrote {written}")
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
