"""``adapter_config.json`` of a ``peft`` LoRA adapter directory: read as hostile data, written as
``PeftModel.from_pretrained`` reads it.

Our adapters are one rank, one alpha and one dropout for every adapted layer, on every layer,
added to the layer's output with no bias (``peft=lora``). A ``peft`` config can say far more, and
every setting that would make its adapter compute something ours does not is refused in one line
naming the key: ranks or alphas that vary by layer (``rank_pattern``, ``alpha_pattern``), a subset
of layers (``layers_to_transform``, ``exclude_modules``), DoRA, biases, extra trained modules
(``modules_to_save``, ``trainable_token_indices``), adapters on expert parameters
(``target_parameters``), activated LoRA, an initialisation that rewrites the base weights (PiSSA,
OLoRA, LoftQ, ...), and target modules given as a regular expression. Keys this code does not know
are left alone: the tensors themselves must still be exactly the ones the accepted keys imply.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional

from megatron_hydra import untrusted
from megatron_hydra.convert.hf_files import CONFIG_BYTES
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.errors import CheckpointError

ADAPTER_CONFIG = "adapter_config.json"
ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output head
# peft's defaults for keys a file leaves out (LoraConfig).
DEFAULT_RANK, DEFAULT_ALPHA = 8, 8

# Keys whose every value but a neutral one (null, false, "", [], {}) changes what the adapter
# computes or trains, and what that value would ask for.
NEUTRAL_ONLY = {
    "use_dora": "DoRA's magnitude vectors",
    "lora_bias": "a bias on the adapters",
    "use_qalora": "QA-LoRA's pooled input",
    "fan_in_fan_out": "transposed (Conv1D) base weights",
    "modules_to_save": "whole modules trained beside the adapters",
    "trainable_token_indices": "trained embedding rows",
    "layers_to_transform": "adapters on some layers only",
    "layer_replication": "replicated layers",
    "exclude_modules": "layers left out of the targets",
    "target_parameters": "adapters on parameters (MoE experts)",
    "alora_invocation_tokens": "activated LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
}
PLAIN_INITS = (True, False, "gaussian")  # initialisations that leave the base weights as they are


@dataclass(frozen=True)
class LoraSettings:
    """What an adapter directory says of its adapters, in our terms; ``modules``: the names of the
    base model's modules it adapts (``q_proj``, ...), or None for ``all-linear``."""

    rank: int
    alpha: float
    dropout: float
    rslora: bool
    modules: Optional[List[str]]


def _neutral(value) -> bool:
    return value is None or value is False or value in ("", [], {})


def _uniform(hf: HFConfig, key: str, value: float) -> None:
    """``rank_pattern`` / ``alpha_pattern``: allowed when every layer it names keeps ``value``."""
    pattern = hf.value(key, dict, {})
    varying = [k for k, v in pattern.items() if v != value]
    if varying:
        raise hf.unsupported(key, pattern, f"one {'rank' if key == 'rank_pattern' else 'alpha'} for every "
                             f"layer is ({varying[0]!r} differs): convert a uniform adapter")


def _modules(hf: HFConfig) -> Optional[List[str]]:
    targets = hf.get("target_modules")
    if targets == ALL_LINEAR:
        return None
    if isinstance(targets, str):
        raise hf.unsupported("target_modules", targets, f"a list of module names, or {ALL_LINEAR!r}, is (not a "
                             "regular expression)")
    names = hf.value("target_modules", list)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise hf.unsupported("target_modules", names, "a non-empty list of module names is")
    return sorted(set(names))


def read(directory: str) -> LoraSettings:
    """The settings of the ``peft`` adapter directory ``directory``; one line for any it does not
    express (module docstring)."""
    path = os.path.join(directory, ADAPTER_CONFIG)
    values = untrusted.load_json(path, CONFIG_BYTES, "peft adapter config", CheckpointError)
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} holds a JSON {type(values).__name__}, not an object; copy the file again")
    hf = HFConfig(values, path)
    hf.model_type = "peft LoRA"
    kind = hf.value("peft_type", str)
    if kind != "LORA":
        raise hf.unsupported("peft_type", kind, "LORA is")
    task = hf.value("task_type", str, "CAUSAL_LM")
    if task != "CAUSAL_LM":
        raise hf.unsupported("task_type", task, "CAUSAL_LM is (an adapter of a causal language model)")
    bias = hf.value("bias", str, "none")
    if bias != "none":
        raise hf.unsupported("bias", bias, "none is (our adapters train no biases)")
    for key, what in NEUTRAL_ONLY.items():
        if not _neutral(hf.get(key)):
            raise hf.unsupported(key, hf.get(key), f"only null or false is (our adapters have no {what})")
    init = hf.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        raise hf.unsupported("init_lora_weights", init, "true, false or gaussian is (this initialisation rewrites "
                             "the base weights the adapter belongs to)")
    rank = hf.count("r", DEFAULT_RANK)
    alpha = hf.value("lora_alpha", float, float(DEFAULT_ALPHA))
    if alpha <= 0:
        raise hf.unsupported("lora_alpha", alpha, "a positive number is")
    dropout = hf.value("lora_dropout", float, 0.0)
    if not 0.0 <= dropout < 1.0:
        raise hf.unsupported("lora_dropout", dropout, "a probability in [0, 1) is")
    _uniform(hf, "rank_pattern", rank)
    _uniform(hf, "alpha_pattern", alpha)
    return LoraSettings(rank, alpha, dropout, hf.value("use_rslora", bool, False), _modules(hf))


def _number(x: float):
    return int(x) if float(x).is_integer() else x


def write(directory: str, settings: LoraSettings, base: Optional[str]) -> None:
    """``adapter_config.json`` for adapters of ``settings`` on the model ``base`` (a Hugging Face
    name or directory; null when unknown, then ``from_pretrained`` is given the base model)."""
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": None,
        "r": settings.rank, "lora_alpha": _number(settings.alpha), "lora_dropout": settings.dropout,
        "use_rslora": settings.rslora, "target_modules": settings.modules, "bias": "none",
        "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True,
        "inference_mode": True,
    }
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
