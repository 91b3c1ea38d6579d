"""lm-evaluation-harness scores of a checkpoint, at any layout:
``python -m megatron_hydra.evaluate checkpoint=CKPT tasks=[hellaswag,path/to/task.yaml] ...``

    checkpoint=PATH            a checkpoint directory (training's step_NNNNNNN, or an import)
    peft.adapter=PATH          LoRA adapters trained on that checkpoint (their rank, alpha and
                               targets are read from them)
    tasks=[...]                lm-eval task names, or paths of local task YAML files (a task over
                               local data needs no network: docs/evaluation.md)
    output=DIR                 where lm-eval's results JSON goes (default <run_dir>/eval)
    limit=N                    the first N examples of each task (default: all)
    num_fewshot=N              few-shot examples per request (default: each task's own)
    batch_size=8               requests per forward pass (per data-parallel rank)
    tokenizer=PATH             a tokenizer.json (default: the checkpoint's own, else its data's)
    run_dir=DIR                the run's directory (default outputs/<date>/<time>-evaluate)
    parallel=pp2 trainer.devices=2 ...   launch.py's parallel=, trainer.*, precision= overrides: the
                               layout and machine it runs on (torchrun and srun start it like launch.py)
    model.KEY=VALUE            on top of the checkpoint's own model

It needs lm-eval (``pip install -e ".[eval]"``). The launcher runs it like training
(``training.inference_job``): each rank builds its stage of the model, loads its part of the
checkpoint, and every rank runs lm-eval's ``simple_evaluate`` on the same requests through our
LM class (``inference.lm_eval_adapter``), which scores and generates with the inference engine;
rank 0 prints lm-eval's table and writes its results JSON. An unknown task or a task file that
does not parse is one line before any worker starts.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from omegaconf import MISSING

from megatron_hydra.config import RunConfig
from megatron_hydra.config.schema import EvalConfig
from megatron_hydra.errors import ConfigError


@dataclass
class EvaluateConfig:
    """This command line's own options (the rest are launch.py's overrides)."""

    checkpoint: str = MISSING
    tasks: List[str] = field(default_factory=list)
    output: Optional[str] = None
    limit: Optional[int] = None
    num_fewshot: Optional[int] = None
    batch_size: int = 8
    tokenizer: Optional[str] = None
    run_dir: Optional[str] = None


def _task(name: str) -> str:
    """A task YAML file by its absolute path (the workers may start elsewhere); a name as it is."""
    return os.path.abspath(os.path.expanduser(name)) if name.endswith((".yaml", ".yml")) else name


def build_config(argv: Sequence[str]) -> RunConfig:
    """The RunConfig of ``mode=evaluate`` for this command line (one line for a bad option)."""
    from megatron_hydra.launcher import detect_external
    from megatron_hydra.parallel.device import visible_gpus
    from megatron_hydra.training.inference_cli import job_config, parse_command_line

    args, launch, model = parse_command_line(EvaluateConfig, argv)
    if not args.tasks:
        raise ConfigError("tasks=[...] is empty: name lm-eval tasks, or paths of local task YAML files")
    external = detect_external()
    cfg = job_config("evaluate", args.checkpoint, launch, model, args.tokenizer, args.run_dir, visible_gpus(),
                     external.local_world_size if external else None)
    output = os.path.abspath(os.path.expanduser(args.output)) if args.output else None
    cfg.trainer.eval = EvalConfig(tasks=[_task(t) for t in args.tasks], every_n_steps=0, limit=args.limit,
                                  num_fewshot=args.num_fewshot, batch_size=args.batch_size, output=output)
    return cfg  # limit, num_fewshot and batch_size are checked with trainer.eval's other values (config.inference)


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_hydra.launcher import run_tool

    return run_tool(__doc__.strip(), build_config, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
