"""From a translation's keys to launch.py overrides: presets where they match exactly, explicit
keys otherwise, and a model YAML when the model is not a preset.

A preset is used only when it gives exactly the translated values (``model=llama3_8b`` for a
Llama 3 8B command line; ``parallel=tp8_pp16``); the flags' other keys are written out. A model
that is no preset is written as ``conf/model/<name>.yaml`` (``--output``), or given as the keys
that differ from the nearest preset that has the same optional parts (MoE, RoPE scaling): an
optional part cannot be switched on by ``model.moe.x=...`` alone.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Dict, List, Optional, Tuple

import yaml
from omegaconf import OmegaConf

from megatron_hydra.config.bundled import CONF_MODULE
from megatron_hydra.config.derive import size_defaults
from megatron_hydra.config.schema import (CheckpointConfig, DataConfig, ModelConfig, MoEConfig, OptimConfig,
                                          ParallelConfig, PrecisionConfig, RopeScalingConfig,
                                          TrainerConfig)
from megatron_hydra.migrate.translation import Translation
from megatron_hydra.migrate.values import hydra_value

GROUPS = {"model": ModelConfig, "parallel": ParallelConfig, "precision": PrecisionConfig, "data": DataConfig,
          "optim": OptimConfig, "trainer": TrainerConfig, "checkpoint": CheckpointConfig}
# conf/config.yaml's defaults
DEFAULT_OPTIONS = {"model": "gpt_tiny", "parallel": "single", "precision": "auto", "data": "demo", "optim": "adamw",
                   "trainer": "auto", "checkpoint": "default"}
NESTED = {"moe": MoEConfig, "rope_scaling": RopeScalingConfig}
SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
         "seq_length")
ORDER = ("trainer", "model", "parallel", "precision", "data", "optim")


@dataclass
class ModelChoice:
    values: Dict[str, Any]  # the translated model, flat (moe.top_k), every key
    name: str
    preset: Optional[str]  # the preset that equals it
    base: str  # the preset the explicit keys start from
    diff: Dict[str, Any]  # flat key -> value that differ from base
    nearest_notes: List[str] = field(default_factory=list)


@lru_cache(maxsize=None)
def option_values(group: str, option: str) -> Dict[str, Any]:
    """``conf/<group>/<option>.yaml`` over the schema, flat (``moe.top_k``; an unset optional part
    is one key with None)."""
    text = resources.files(CONF_MODULE).joinpath(group).joinpath(f"{option}.yaml").read_text()
    node = OmegaConf.merge(OmegaConf.structured(GROUPS[group]), OmegaConf.create(text))
    return _flat(OmegaConf.to_container(node, resolve=False))


@lru_cache(maxsize=None)
def options(group: str) -> Tuple[str, ...]:
    folder = resources.files(CONF_MODULE).joinpath(group)
    return tuple(sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml")))


def _flat(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key in NESTED:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def translated_model(t: Translation) -> Dict[str, Any]:
    """Every model key: the schema's defaults, then the translation's values."""
    values = _flat(OmegaConf.to_container(OmegaConf.structured(ModelConfig)))
    for part, cls in NESTED.items():
        if any(k.startswith(f"model.{part}.") for k in t.keys):
            values.pop(part, None)
            values.update({f"{part}.{f.name}": _default(f) for f in dataclasses.fields(cls)})
    values.update({k[len("model."):]: v for k, v in t.keys.items() if k.startswith("model.")})
    return values


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def choose_model(t: Translation, name: Optional[str]) -> ModelChoice:
    ours = translated_model(t)
    gpt = [o for o in options("model") if o != "from_checkpoint" and option_values("model", o)["arch"] == "gpt"]
    exact = [o for o in gpt if _differences(ours, option_values("model", o)) == {}]
    if exact:
        preset = "gpt_tiny" if "gpt_tiny" in exact else exact[0]
        return ModelChoice(ours, preset, preset, preset, {})
    usable = [o for o in gpt if _parts(ours) <= _parts(option_values("model", o))]
    base = min(usable or ["gpt_tiny"], key=lambda o: (len(_differences(ours, option_values("model", o))), o))
    mine = _resolved(ours)
    same_shape = sorted((o for o in gpt if all(mine[k] == _resolved(option_values("model", o))[k] for k in SHAPE)),
                        key=lambda o: (len(_differences(ours, option_values("model", o))), o))
    chosen = name or (f"{same_shape[0]}_megatron" if same_shape else
                      f"megatron_{ours['num_layers']}l_{ours['hidden_size']}h")
    ours["name"] = chosen
    notes = []
    if same_shape:
        other = option_values("model", same_shape[0])
        what = ", ".join(f"{k}={hydra_value(v)} ({'set' if k not in other else hydra_value(other[k])} there)"
                         for k, v in _differences(ours, other).items())
        notes.append(f"the shape is model={same_shape[0]}'s, but it differs in: {what}")
    base_values = option_values("model", base)  # the keys that compose ours on top of base, as they are
    diff = {k: v for k, v in ours.items() if base_values.get(k, _MISSING) != v}
    return ModelChoice(ours, chosen, None, base, diff, notes)


def _parts(values: Dict[str, Any]) -> set:
    """The optional parts (MoE, RoPE scaling) a model has."""
    return {p for p in NESTED if any(k.startswith(f"{p}.") for k in values)}


def _differences(ours: Dict[str, Any], other: Dict[str, Any]) -> Dict[str, Any]:
    """The models' differences once null keys take the values derive gives them (``kv_channels``
    null is hidden / heads); an optional part we lack that ``other`` has is one key, null."""
    mine, theirs = _resolved(ours), _resolved(other)
    return {k: v for k, v in ours.items() if k != "name" and theirs.get(k, _MISSING) != mine[k]}


def _resolved(values: Dict[str, Any]) -> Dict[str, Any]:
    """``values`` with the nulls that config.derive fills in filled in the same way."""
    out = dict(values)
    sizes = size_defaults(out["hidden_size"], out["num_attention_heads"], out["activation"], out["seq_length"])
    for key, value in sizes.items():
        if out[key] is None:
            out[key] = value
    for key, value in (("qkv_bias", out["add_bias_linear"]), ("moe.ffn_hidden_size", out["ffn_hidden_size"])):
        if key in out and out[key] is None:
            out[key] = value
    return out


_MISSING = object()


def model_yaml(choice: ModelChoice) -> str:
    """``conf/model/<name>.yaml``: the shape, and every key that differs from the schema's default."""
    defaults = _flat(OmegaConf.to_container(OmegaConf.structured(ModelConfig)))
    tree: Dict[str, Any] = {"name": choice.name}
    for key, value in choice.values.items():
        part, _, sub = key.partition(".")
        if sub:
            cls = NESTED[part]
            default = _default(next(f for f in dataclasses.fields(cls) if f.name == sub))
            if value != default or sub in ("num_experts", "top_k", "type", "factor"):
                tree.setdefault(part, {})[sub] = value
        elif key in SHAPE[:3] + ("seq_length", "vocab_size") or (key != "name" and value != defaults.get(key)):
            tree[key] = value
    header = ("# Translated from a Megatron-LM command line by python -m megatron_hydra.migrate.\n"
              f"# Use it as model={choice.name} (conf/model/{choice.name}.yaml, or hydra.searchpath).\n")
    return header + yaml.safe_dump(tree, sort_keys=False)


def overrides(t: Translation, choice: ModelChoice, output: Optional[str]) -> List[str]:
    """launch.py's arguments for the translation, groups first."""
    groups = dict(t.groups)
    keys = {k: v for k, v in t.keys.items() if not k.startswith("model.")}
    parallel = _parallel_preset(keys)
    if parallel:
        groups["parallel"] = parallel
        keys.pop("parallel.tensor_parallel_size")
        keys.pop("parallel.pipeline_parallel_size")
    out = [f"{g}={groups[g]}" for g in ORDER if g in groups and g != "model"]
    if choice.preset:
        out.insert(1, f"model={choice.preset}")
    elif output:
        out.insert(0, f"hydra.searchpath=[{hydra_value('file://' + os.path.abspath(output))}]")
        out.insert(2, f"model={choice.name}")
    else:
        out.insert(1, f"model={choice.base}")
        out += [f"model.{k}={hydra_value(v)}" for k, v in choice.diff.items()]
    for key, value in keys.items():
        group, _, sub = key.partition(".")
        if group in GROUPS and not t.sources[key]:
            default = option_values(group, groups.get(group, DEFAULT_OPTIONS[group])).get(sub, _MISSING)
            if default == value:
                continue
        out.append(f"{key}={hydra_value(value)}")
    return out


def _parallel_preset(keys: Dict[str, Any]) -> Optional[str]:
    tp, pp = keys.get("parallel.tensor_parallel_size", 1), keys.get("parallel.pipeline_parallel_size", 1)
    for option in options("parallel"):
        values = option_values("parallel", option)
        if (values["tensor_parallel_size"], values["pipeline_parallel_size"]) == (tp, pp):
            return option
    return None
