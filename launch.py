"""Hydra entry point: ``python launch.py model=gpt_125m parallel=tp2 trainer.devices=2 ...``.

Composes ``conf/``, types it against the schema, validates it, then hands it to the launcher,
which runs this process as a worker (torchrun/SLURM) or spawns the local workers. User errors
(bad config, data or checkpoint) print one line and exit with status 2.
"""

import sys
from typing import Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from megatron_hydra.config import register_configs
from megatron_hydra.errors import ConfigError, MegatronHydraError

register_configs()


def _check_sweep_objective(run_cfg) -> None:
    """An optimising sweeper needs a number back from every trial: the final validation loss."""
    from hydra.core.hydra_config import HydraConfig

    sweeper = HydraConfig.get().sweeper.get("_target_", "") if HydraConfig.initialized() else ""
    if "optuna" in sweeper and run_cfg.trainer.val_check_interval == 0:
        raise ConfigError(
            "hydra/sweeper=optuna minimises the final validation loss, but trainer.val_check_interval=0 "
            "disables validation: set it (e.g. to trainer.max_steps)"
        )


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> Optional[float]:
    from megatron_hydra.launcher import WorkerFailed, run

    try:
        run_cfg = OmegaConf.to_object(cfg)
        _check_sweep_objective(run_cfg)
        # The final validation loss: the objective a sweeper (hydra/sweeper=optuna) minimises.
        return run(run_cfg)
    except WorkerFailed as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except MegatronHydraError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
