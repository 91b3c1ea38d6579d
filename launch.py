"""Hydra entry point: ``python launch.py model=gpt_125m parallel=tp2 trainer.devices=2 ...``.

Composes ``conf/``, types it against the schema, validates it, then hands it to the launcher,
which runs this process as a worker (torchrun/SLURM) or spawns the local workers. User errors
(bad config, data or checkpoint; also a YAML syntax error in a config file or an output directory
that cannot be created) print one line and exit with status 2; a failed worker exits with 1; a run
stopped at once by a second SIGTERM/SIGINT with 128 + the signal number.

In a multirun (``-m``) a failed job prints one line naming its directory and the sweep goes on;
at the end a summary line names the failed jobs and the exit status is 1. An error every job would
meet (an unknown key, an Optuna sweep without validation) ends the sweep at once, status 2.
"""

import os
import re
import sys
from typing import List, Optional

import hydra
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_hydra.config import register_configs
from megatron_hydra.errors import ConfigError, MegatronHydraError, one_line

register_configs()
_CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")  # hydra.main's config_path
_jobs: List[str] = []  # run dirs of this process's multirun jobs
_failed: List[str] = []  # ...and of those that failed
_json_stdout = False  # --json: mode=verify prints its verdict as JSON (taken out of argv before Hydra)


def _check_sweep_objective(run_cfg) -> None:
    """An optimising sweeper needs a number back from every trial: the final validation loss."""
    from hydra.core.hydra_config import HydraConfig

    sweeper = HydraConfig.get().sweeper.get("_target_", "") if HydraConfig.initialized() else ""
    if "optuna" in sweeper and run_cfg.trainer.val_check_interval == 0:
        raise ConfigError(
            "hydra/sweeper=optuna minimises the final validation loss, but trainer.val_check_interval=0 "
            "disables validation: set it (e.g. to trainer.max_steps)"
        )
    if "optuna" in sweeper and "csv" not in run_cfg.trainer.logger:
        raise ConfigError(
            f"hydra/sweeper=optuna reads each trial's final validation loss from csv/metrics.csv, but "
            f"trainer.logger={list(run_cfg.trainer.logger)} has no csv: add it"
        )


def _multirun_job_dir() -> Optional[str]:
    """This job's output dir when it is one job of a local multirun (a SLURM job of a sweep runs
    in its own process: there a failure ends that job, as a single run would)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or "SUBMITIT_EXECUTOR" in os.environ:
        return None
    hydra_cfg = HydraConfig.get()
    return hydra_cfg.runtime.output_dir if hydra_cfg.mode == RunMode.MULTIRUN else None


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> Optional[float]:
    from megatron_hydra.checkpoint.model_source import FROM_CHECKPOINT, model_config
    from megatron_hydra.config.known_keys import check_known_keys
    from megatron_hydra.launcher import Interrupted, WorkerFailed, run

    job_dir = _multirun_job_dir()
    if job_dir is not None:
        _jobs.append(job_dir)
    try:
        check_known_keys(cfg)
        if cfg.model.name == FROM_CHECKPOINT:
            cfg.model = model_config(cfg.checkpoint.load, _model_overrides())
        run_cfg = OmegaConf.to_object(cfg)
        _check_sweep_objective(run_cfg)
    except MegatronHydraError as e:  # every job of a sweep would fail the same way: stop it here
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OmegaConfBaseException as e:  # e.g. model.name='${nope}': an interpolation that does not resolve
        print(f"error: {_omegaconf_error_line(e)}", file=sys.stderr)
        sys.exit(2)
    try:
        if run_cfg.mode == "verify":  # above the launcher: it starts its runs through it
            from megatron_hydra.verify import verify_job

            verify_job(run_cfg, json_stdout=_json_stdout)
            return None
        # The final validation loss: the objective a sweeper (hydra/sweeper=optuna) minimises.
        return run(run_cfg)
    except Interrupted as e:  # the user stopped the run: in a sweep, the sweep too
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except MegatronHydraError as e:
        if job_dir is None:
            print(f"error: {one_line(e)}", file=sys.stderr)
            sys.exit(1 if isinstance(e, WorkerFailed) else 2)
        # A failed trial, not a failed sweep. Its objective is the worst loss, inf: Optuna refuses
        # NaN (it would end the sweep) and ranks inf last.
        print(f"error: job {job_dir} failed: {one_line(e)}", file=sys.stderr)
        _failed.append(job_dir)
        return float("inf")


def _model_overrides() -> List[tuple]:
    """The command line's ``model.<key>=<value>`` overrides as (key, value) pairs: with
    ``model=from_checkpoint`` they apply on top of the checkpoint's own model."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not HydraConfig.initialized():
        return []
    parsed = OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))
    return [(o.key_or_group[len("model."):], o.value()) for o in parsed
            if o.key_or_group.startswith("model.") and not o.is_delete()]


def _omegaconf_error_line(exc: OmegaConfBaseException) -> str:
    """OmegaConf's multi-line message as one line that names the key."""
    key = getattr(exc, "full_key", None)
    return f"{key + ': ' if key else ''}{one_line(exc)}: fix that value on the command line or in its config file"


def _hydra_error_line(exc: BaseException) -> Optional[str]:
    """One line for the user errors Hydra meets before ``main`` runs; None for anything else."""
    from hydra.errors import CompactHydraException, MissingConfigException

    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return (f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: YAML syntax error "
                f"({exc.problem or exc.context}): fix the file")
    if isinstance(exc, yaml.YAMLError):
        return f"YAML syntax error in a config file ({str(exc).splitlines()[0]}): fix the file"
    if isinstance(exc, MissingConfigException) and exc.options and "/" in (exc.missing_cfg_file or ""):
        group, _, option = exc.missing_cfg_file.rpartition("/")
        return (f"{group}={option}: config group '{group}' has no option '{option}'; "
                f"available: {', '.join(exc.options)}")
    if isinstance(exc, CompactHydraException):
        sweep = re.match(r"Ambiguous value for argument '(.*)'\n", str(exc))
        return _sweep_outside_multirun(sweep.group(1)) if sweep else " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.filename is not None:
        return (f"{exc.filename}: {exc.strerror or type(exc).__name__}: Hydra cannot read the config or create the "
                "output directory there; check the path, or set hydra.run.dir (hydra.sweep.dir with -m) to a "
                "writable directory")
    return None


def _sweep_outside_multirun(override: str) -> str:
    """A comma list without ``-m`` is a Hydra sweep; the fix depends on what was meant."""
    key, _, value = override.partition("=")
    if os.path.isdir(os.path.join(_CONF, key.lstrip("+~"))):  # a config group: several runs
        return f"{override}: a comma list is a sweep over config group '{key}'; add -m to run one job per option"
    return (f"{override}: a comma list outside -m is a sweep; for one value quote it, \"{key}='{value}'\" "
            f"(the shell drops bare quotes), or write a list, {key}=[{value}]; add -m to sweep")


def cli() -> int:
    """Run ``main`` with Hydra's own user errors (a config file that is not YAML, an output dir it
    cannot create, an unknown option of a config group, a comma list without ``-m``) as one line,
    exit status 2. HYDRA_FULL_ERROR=1 makes Hydra raise instead of printing a traceback; set by
    the user, it keeps every traceback."""
    global _json_stdout
    if "--json" in sys.argv[1:]:
        sys.argv.remove("--json")
        _json_stdout = True
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while Hydra composes, before the launcher owns the signal
        print("error: stopped by SIGINT before the run started: nothing was saved", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - sorted into user errors (one line) and the rest (raised)
        line = None if full_error else _hydra_error_line(exc)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    if _failed:
        print(f"error: {len(_failed)} of {len(_jobs)} sweep jobs failed: {', '.join(_failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
