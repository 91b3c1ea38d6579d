"""Hydra entry point: ``python launch.py model=gpt_125m parallel=tp2 trainer.devices=2 ...``.

Composes ``conf/``, types it against the schema, validates it, then hands it to the launcher,
which runs this process as a worker (torchrun/SLURM) or spawns the local workers. User errors
(bad config, data or checkpoint) print one line and exit with status 2.
"""

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from megatron_hydra.config import register_configs
from megatron_hydra.errors import MegatronHydraError

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from megatron_hydra.launcher import WorkerFailed, run

    try:
        run(OmegaConf.to_object(cfg))
    except WorkerFailed as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except MegatronHydraError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
