"""``mode=verify``: is this job right, and does it fit? On one CPU machine, before a GPU hour.

The job is shrunk (``shrink``), trained in float64 at its layout on gloo ranks and in one process
(``exact``), resumed from its step-K checkpoint at another layout, and its full-size dry run is
held against a GPU's memory (``fits``). docs/verify.md describes the checks and the JSON."""

from __future__ import annotations

import os
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional

from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.errors import ConfigError
from megatron_hydra.launcher import WorkerFailed
from megatron_hydra.verify.report import Check, Verdict, describe

CHECKS = ("exact", "fits", "resume")


class VerifyFailed(WorkerFailed):
    """A check failed: exit status 1, as a failed run (a bad config stays 2)."""


def _check_settings(cfg: RunConfig) -> None:
    v = cfg.verify
    unknown = [c for c in v.checks if c not in CHECKS]
    if unknown or not v.checks:
        raise ConfigError(f"verify.checks={list(v.checks)}: use a non-empty subset of {list(CHECKS)}")
    if v.steps < 1 or not v.tolerance > 0 or v.max_ranks < 1:
        raise ConfigError(f"verify.steps={v.steps}, verify.tolerance={v.tolerance} and verify.max_ranks={v.max_ranks} "
                          "must be positive")


def _timed(name: str, fn) -> Check:
    start = time.monotonic()
    check = fn()
    check.name, check.seconds = name, time.monotonic() - start
    return check


def verify_job(job: RunConfig, json_stdout: bool = False) -> Verdict:
    """``launch.py ... mode=verify``: the job resolved for this machine and derived as the
    launcher would, then verified (``run_verify``)."""
    from megatron_hydra.config import derive
    from megatron_hydra.launcher import detect_external, resolve_for_machine

    cfg = resolve_for_machine(job, detect_external())
    return run_verify(cfg, derive(cfg), json_stdout)


def run_verify(cfg: RunConfig, derived: Derived, json_stdout: bool = False) -> Verdict:
    """Run the chosen checks, print the verdict (JSON on stdout with ``json_stdout``; also to
    ``verify.output``), and raise ``VerifyFailed`` unless every check passed."""
    _check_settings(cfg)
    if "fits" in cfg.verify.checks:  # the stand-in GPU registers on import: before this process's first backward
        import megatron_hydra.training.dry_run  # noqa: F401
    v = cfg.verify
    root = os.path.join(cfg.run_dir, "verify")
    shutil.rmtree(root, ignore_errors=True)  # this mode's own runs of an earlier verify here
    with _stdout_to_stderr() if json_stdout else nullcontext():  # stdout: the JSON alone
        verdict = _run_checks(cfg, derived, root)
    _emit(verdict, json_stdout, v.output)
    if not verdict.passed:
        failed = [f"{c.name} ({c.detail})" for c in verdict.checks if c.passed is False]
        raise VerifyFailed(f"mode=verify: {len(failed)} of {len(verdict.checks)} checks failed: {'; '.join(failed)}")
    return verdict


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 pointed at 2 for the block: this process's and its workers' output."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _run_checks(cfg: RunConfig, derived: Derived, root: str) -> Verdict:
    from megatron_hydra.verify.exact import layout_name
    from megatron_hydra.verify.shrink import shrink

    v = cfg.verify
    layout = f"{describe(derived)} ({derived.world_size} ranks)"
    if "exact" not in v.checks and "resume" not in v.checks:
        # fits alone runs the full-size job (its dry run swaps what it must, e.g. Transformer
        # Engine): shrinking, and what it refuses, is for the float64 runs only.
        verdict = Verdict(cfg.model.name, layout, "not shrunk (fits runs the full-size job)")
        verdict.checks.append(_timed("fits", lambda: _fits(verdict, cfg)))
        return verdict
    shrunk = shrink(cfg, derived, os.path.join(root, "layout"))
    m = shrunk.cfg.model
    verdict = Verdict(cfg.model.name, layout, f"{layout_name(shrunk.cfg)}, {m.num_layers} layers, "
                      f"hidden {m.hidden_size}, {m.num_attention_heads} heads, seq {m.seq_length}, float64, "
                      f"{v.steps} steps", shrunk.reduced)
    if "fits" in v.checks:
        verdict.checks.append(_timed("fits", lambda: _fits(verdict, cfg)))
    _layout_checks(verdict, shrunk, root, v)
    return verdict


def _compared(diff, tolerance: float, what: str) -> Check:
    """A comparing check's row: passed only where ``diff.passes`` (a NaN loss or weight fails)."""
    return Check("", diff.passes(tolerance), diff.largest, detail=diff.first or what)


def _layout_checks(verdict: Verdict, shrunk, root: str, v) -> None:
    from megatron_hydra.verify import exact as ex

    extra = 1 if "resume" in v.checks else 0
    state = {}

    def run_exact() -> Check:
        diff, state["layout"] = ex.exact(shrunk, root, v.steps, v.tolerance, extra, "exact" in v.checks)
        what = f"losses, grad norms and weights of {v.steps} steps against one process"
        return _compared(diff, v.tolerance, what)

    exact = _timed("exact", run_exact)
    if "exact" in v.checks:
        verdict.checks.append(exact)
    if "resume" in v.checks:
        def run_resume() -> Check:
            if state["layout"] is None:
                return Check("", False, None, detail="the layout run failed: " + exact.detail)
            diff, where = ex.resume(shrunk, state["layout"], root, v.steps, v.tolerance, v.max_ranks)
            if diff is None:
                return Check("", None, None, detail=f"skipped: {where}")
            return _compared(diff, v.tolerance, f"step {v.steps} resumed at {where}, step {v.steps + 1} compared")
        verdict.checks.append(_timed("resume", run_resume))


def _fits(verdict: Verdict, cfg: RunConfig) -> Check:
    from megatron_hydra.verify.fits import fits

    ok, text, notes = fits(cfg)
    verdict.fit_table = text
    verdict.notes += [f"fits: {n}" for n in notes]
    return Check("", ok, None, detail=text.splitlines()[-1])


def _emit(verdict: Verdict, json_stdout: bool, output: Optional[str]) -> None:
    if output:
        with open(output, "w") as f:
            f.write(verdict.to_json() + "\n")
    print(verdict.to_json() if json_stdout else verdict.table(), file=sys.stdout, flush=True)
