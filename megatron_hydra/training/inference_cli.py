"""The run config of ``python -m megatron_hydra.generate`` and ``python -m megatron_hydra.evaluate``:
a checkpoint's model at a layout, composed as ``launch.py`` would compose it.

A command line mixes the tool's own options (``prompt=``, ``tasks=[...]``, ``sampling.top_p=``;
typed by the tool's dataclass, ``config.cli``) with ``launch.py``'s overrides of the groups that
say where and how the model runs: ``parallel=tp2``, ``trainer.devices=2``, ``trainer=gpu``,
``precision=bf16``, and ``model.*`` on top of the checkpoint's own model. Those are composed from
the bundled ``conf/`` (``config.bundled``); the model is the checkpoint's (``model=from_checkpoint``
semantics: read from its ``meta.json`` as data, ``checkpoint.model_source``), and so is the data
section, which says how its text was tokenized. A checkpoint of another family (BERT, T5) is
refused here, before anything is composed. ``peft.adapter=PATH`` adds LoRA adapters trained on
the checkpoint; their rank, targets and scale are theirs (``checkpoint.adapters``), so it is the
one ``peft`` option a command line gives.
"""

from __future__ import annotations

import os
import time
from dataclasses import fields
from typing import Any, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from megatron_hydra.checkpoint import adapters, standalone, store
from megatron_hydra.checkpoint.model_source import model_config, stored_model
from megatron_hydra.config import RunConfig, bundled
from megatron_hydra.config.cli import parse_args
from megatron_hydra.config.machine import resolve
from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.errors import CheckpointError, ConfigError, one_line

# launch.py's groups a tool's command line may override (model.* apply to the checkpoint's model).
LAUNCH_GROUPS = ("parallel", "trainer", "precision")
ADAPTER_KEY = "peft.adapter"  # passed with the launch overrides; job_config takes it out


def parse_command_line(schema, argv: Sequence[str]) -> Tuple[Any, List[str], List[Tuple[str, Any]]]:
    """The tool's options (an instance of ``schema``), the overrides of ``LAUNCH_GROUPS``, and the
    ``model.*`` overrides as (key below ``model.``, typed value) pairs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    own_keys = [f.name for f in fields(schema)]
    own, launch, model = [], [], []
    for item in argv:
        key = item.partition("=")[0]
        top = key.lstrip("+~").split(".")[0]
        if top == "peft" and key != ADAPTER_KEY:
            raise ConfigError(f"argument {item!r}: {ADAPTER_KEY}=PATH is the one peft option here (the adapter "
                              "checkpoint's own config gives its rank, alpha and targets)")
        if "=" not in item or (top not in own_keys and top not in (*LAUNCH_GROUPS, "model", "peft")):
            raise ConfigError(f"argument {item!r} is not one of this tool's key=value options "
                              f"({', '.join(own_keys)}) nor an override of {', '.join(LAUNCH_GROUPS)}, model.* or "
                              f"{ADAPTER_KEY}")
        if top == "model":
            model.append(item)
        else:
            (own if top in own_keys else launch).append(item)
    try:
        parsed = OverridesParser.create().parse_overrides(model)
    except Exception as e:  # noqa: BLE001 - Hydra's grammar errors, as one line
        raise ConfigError(f"{' '.join(str(e).split())}") from None
    pairs = [(o.key_or_group[len("model."):], o.value()) for o in parsed if o.key_or_group.startswith("model.")]
    if len(pairs) != len(model):
        raise ConfigError(f"{model[0]}: give model.<key>=<value> (the model is the checkpoint's own)")
    return parse_args(schema, own), launch, pairs


def default_run_dir(mode: str) -> str:
    """Where a tool's run writes its resolved config, worker logs and (evaluate) results when
    ``run_dir=`` is not given: beside launch.py's runs, ``outputs/<date>/<time>-<mode>``."""
    return os.path.join("outputs", time.strftime("%Y-%m-%d"), time.strftime("%H-%M-%S") + f"-{mode}")


def job_config(mode: str, checkpoint: str, launch: Sequence[str], model_overrides: Sequence[Tuple[str, Any]],
               tokenizer: Optional[str], run_dir: Optional[str], visible_gpus: int,
               local_ranks: Optional[int]) -> RunConfig:
    """The RunConfig of ``mode`` (generate | evaluate) on the checkpoint at ``checkpoint``, on a
    machine with ``visible_gpus`` GPUs (``local_ranks``: the ranks torchrun/srun started here)."""
    path = os.path.abspath(os.path.expanduser(checkpoint))
    adapter = _take_adapter(launch)
    launch = [o for o in launch if o.partition("=")[0] != ADAPTER_KEY]
    adapters.refuse_adapter_only(path, "checkpoint", store.validate(path, "checkpoint"))
    arch = stored_model(path).get("arch", "gpt")
    if arch != "gpt":
        raise CheckpointError(f"checkpoint={checkpoint} holds a model.arch={arch} model: {mode} needs a causal "
                              "language model of the GPT family (GPT-2, Llama, Qwen, Mistral, Gemma, ...)")
    model = OmegaConf.to_object(model_config(path, model_overrides))
    stored = standalone.read_config(path)
    launch = list(launch)
    if local_ranks is not None and not any(o.partition("=")[0] == "trainer.devices" for o in launch):
        launch.append(f"trainer.devices={local_ranks}")
    cfg = _compose(launch, visible_gpus)
    cfg.model, cfg.data, cfg.mode = model, stored.data, mode
    if cfg.trainer.accelerator == "cpu" and not any(key == "transformer_impl" for key, _ in model_overrides):
        cfg.model.transformer_impl = "local"  # a checkpoint is the same whichever implementation wrote it
    # The batch is the tool's (generation.batch_size, trainer.eval.batch_size): the training one is
    # derived anew for this layout, and no data loader runs.
    cfg.data.global_batch_size, cfg.data.num_workers = None, 0
    cfg.checkpoint.load, cfg.checkpoint.load_optimizer = path, False
    cfg.run_dir = os.path.abspath(run_dir or default_run_dir(mode))
    if adapter:
        cfg = adapters.adopt(cfg, adapter)
    own = os.path.join(path, "tokenizer.json")
    if tokenizer:
        tokenizer = os.path.abspath(os.path.expanduser(tokenizer))
        if not os.path.isfile(tokenizer):
            raise ConfigError(f"tokenizer={tokenizer}: no such file; give the path of a tokenizer.json")
        cfg.data.tokenizer = TokenizerConfig(type="hf", path=tokenizer)
    elif os.path.isfile(own):  # an import's own tokenizer, wherever the checkpoint has moved since
        cfg.data.tokenizer = TokenizerConfig(type="hf", path=own)
    return resolve(cfg, visible_gpus, local_ranks)


def _take_adapter(launch: Sequence[str]) -> Optional[str]:
    """The value of ``peft.adapter=`` among the launch overrides (the last one given), if any."""
    given = [o.partition("=")[2].strip("'\"") for o in launch if o.partition("=")[0] == ADAPTER_KEY]
    return (given[-1] or None) if given else None


def _compose(overrides: List[str], visible_gpus: int) -> RunConfig:
    """``conf/`` composed with ``overrides``; Hydra's own errors (an unknown option of a group, a
    key the schema lacks, a value of the wrong type) as one line."""
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return bundled.compose(overrides, visible_gpus)
    except MissingConfigException as e:
        group, _, option = (e.missing_cfg_file or "").rpartition("/")
        if e.options and group:
            raise ConfigError(f"{group}={option}: config group '{group}' has no option '{option}'; available: "
                              f"{', '.join(e.options)}") from None
        raise ConfigError(one_line(e)) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"{one_line(e).rstrip('.')}: fix that override") from None
