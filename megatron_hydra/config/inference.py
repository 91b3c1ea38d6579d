"""What generation and lm-eval evaluation need of a config (``mode=generate``, ``mode=evaluate``,
and ``trainer.eval`` during training), checked by ``derive`` before any worker starts.

The inference engine (``inference.engine``) runs one model chunk per rank and feeds one token per
generation step: so no virtual pipeline stages and no context parallelism (a step's one token
cannot be split over ranks). It scores and samples causally: the GPT family only. The engine
refuses these too, but in every worker; here they are one line before any starts.
"""

from __future__ import annotations

import os

from megatron_hydra.config.schema import RunConfig
from megatron_hydra.errors import ConfigError

INFERENCE_MODES = ("generate", "evaluate")


def evaluating_during_training(cfg: RunConfig) -> bool:
    """``trainer.eval`` is on for this training run."""
    return cfg.mode == "train" and cfg.trainer.eval.every_n_steps > 0 and bool(cfg.trainer.eval.tasks)


def eval_output_dir(cfg: RunConfig) -> str:
    """Where lm-eval's results JSON goes: ``trainer.eval.output``, else ``<run_dir>/eval``."""
    return cfg.trainer.eval.output or os.path.join(cfg.run_dir, "eval")


def check_inference(cfg: RunConfig) -> None:
    """One line for a config the engine cannot run, or ``trainer.eval`` / ``generation`` values
    out of range."""
    _check_eval_values(cfg)
    if cfg.mode in INFERENCE_MODES:
        _check_generation_values(cfg)
        what = f"mode={cfg.mode}"
        if not cfg.checkpoint.load:
            raise ConfigError(f"{what} needs checkpoint.load=<checkpoint directory>: the weights to "
                              f"{'generate with' if cfg.mode == 'generate' else 'evaluate'}")
        if cfg.mode == "evaluate" and not cfg.trainer.eval.tasks:
            raise ConfigError("mode=evaluate needs trainer.eval.tasks=[...]: lm-eval task names or task YAML files")
    elif evaluating_during_training(cfg):
        what = "trainer.eval.tasks (evaluation during training)"
    else:
        return
    _check_layout(cfg, what)


def _check_layout(cfg: RunConfig, what: str) -> None:
    par = cfg.parallel
    if cfg.model.arch != "gpt":
        raise ConfigError(f"model.arch={cfg.model.arch}: {what} needs a causal language model of the GPT family "
                          "(GPT-2, Llama, Qwen, Mistral, Gemma, ...); BERT and T5 do not generate text")
    if par.context_parallel_size > 1:
        raise ConfigError(f"parallel.context_parallel_size={par.context_parallel_size}: {what} runs without context "
                          "parallelism (a generation step is one token long): set parallel.context_parallel_size=1")
    if (par.virtual_pipeline_size or 1) > 1:
        raise ConfigError(f"parallel.virtual_pipeline_size={par.virtual_pipeline_size}: {what} runs one pipeline "
                          "stage per rank: set parallel.virtual_pipeline_size=null (and pipeline_schedule=1f1b)")


def _check_eval_values(cfg: RunConfig) -> None:
    ev = cfg.trainer.eval
    if ev.every_n_steps < 0:
        raise ConfigError(f"trainer.eval.every_n_steps={ev.every_n_steps} must be >= 0 (0: no evaluation during "
                          "training)")
    if ev.every_n_steps > 0 and not ev.tasks and cfg.mode == "train":
        raise ConfigError(f"trainer.eval.every_n_steps={ev.every_n_steps} but trainer.eval.tasks is empty: give the "
                          "tasks (trainer.eval.tasks=[name or path/to/task.yaml]), or set every_n_steps=0")
    if ev.limit is not None and ev.limit < 1:
        raise ConfigError(f"trainer.eval.limit={ev.limit} must be a positive integer, or null (every example)")
    if ev.num_fewshot is not None and ev.num_fewshot < 0:
        raise ConfigError(f"trainer.eval.num_fewshot={ev.num_fewshot} must be >= 0, or null (each task's own)")
    if ev.batch_size < 1:
        raise ConfigError(f"trainer.eval.batch_size={ev.batch_size} must be a positive integer")


def _check_generation_values(cfg: RunConfig) -> None:
    gen = cfg.generation
    if gen.max_new_tokens < 1:
        raise ConfigError(f"generation.max_new_tokens={gen.max_new_tokens} must be >= 1")
    if gen.batch_size < 1:
        raise ConfigError(f"generation.batch_size={gen.batch_size} must be a positive integer")
    if cfg.mode == "generate" and not gen.prompts:
        raise ConfigError("generation.prompts is empty: give at least one prompt (\"\" starts from end-of-document)")
