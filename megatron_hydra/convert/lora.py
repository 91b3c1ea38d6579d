"""LoRA adapters out to Hugging Face and ``peft``, and in from ``peft``.

Three conversions (``convert.api``, ``python -m megatron_hydra.convert``):

- ``to_hf input=BASE adapter=ADAPTERS merge=true``: the base's Hugging Face export with every
  adapted weight W written as W + scale * B A, as ``peft``'s ``merge_and_unload`` forms it. The
  export streams as the plain one does: a weight is merged when the writer reaches it, with only
  its own adapters read beside it. The fused QKV gets q's, k's and v's own B A, fused per query
  group like the weight (``mapping.fuse_qkv``), since b_q's rows are q_proj's rows.
- ``to_hf input=ADAPTERS``: a ``peft`` adapter directory (``adapter_config.json``,
  ``adapter_model.safetensors``) that ``PeftModel.from_pretrained`` loads onto the base's Hugging
  Face export. a_q / b_q, a_k / b_k, a_v / b_v are q_proj's, k_proj's and v_proj's lora_A /
  lora_B one for one, and every other adapter is the adapter of the one Hugging Face linear layer
  its weight is (the family's name map says which). An adapted weight that is not one Hugging Face
  linear layer as it stands (GPT-2's fused, transposed c_attn) has no ``peft`` form: merge it.
- ``from_hf input=PEFT_DIR base=BASE``: the reverse, into an adapter checkpoint for the base, its
  settings checked first (``convert.peft_config``). An adapter of some of q, k and v (``q_proj``
  and ``v_proj`` is ``peft``'s classic choice) gets zero A and B for the others: the same function,
  and they stay zero in training (with both factors zero neither has a gradient).

An adapter checkpoint is a checkpoint whose model tensors are exactly the adapters
(``layers.3.attention.qkv.lora.a_q``, ...) and whose ``meta.json`` says ``adapter_only`` and holds
the run's config (the base's model and the ``peft`` settings). Any checkpoint whose config has
``peft=lora`` holds adapters, a full one too, so either is a source of adapters here. Its adapters
must be exactly those its ``peft`` settings give the base model, name for name and shape for
shape, or the conversion stops in one line: they belong to another base.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch

from megatron_hydra.checkpoint import plan, sharded, standalone, store
from megatron_hydra.checkpoint.lazy_write import LazyTensor
from megatron_hydra.checkpoint.selection import ADAPTER_MARK, select_names
from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.config.derive import DTYPES
from megatron_hydra.config.transformer_config import LORA_TARGETS
from megatron_hydra.config.schema import PeftConfig
from megatron_hydra.config.transformer_config import LoRASpec, TransformerConfig
from megatron_hydra.convert import hf_files, peft_config, staging
from megatron_hydra.convert.families import family_for
from megatron_hydra.parallel.lora import is_down_projection
from megatron_hydra.convert.mapping import fuse_qkv
from megatron_hydra.convert.name_map import IDENTITY, QKV
from megatron_hydra.errors import CheckpointError, ConfigError

PEFT_PREFIX = "base_model.model."  # PeftModel's name for the Hugging Face model it wraps
ADAPTER_WEIGHTS, ADAPTER_BIN = "adapter_model.safetensors", "adapter_model.bin"
SEGMENTS = ("q", "k", "v")  # the fused QKV's adapters, in mapping.fuse_qkv's order


def _segment(a_name: str) -> str:
    """``...qkv.lora.a_q`` -> ``q``; ``...proj.lora.a`` -> ``''``."""
    return a_name.partition(ADAPTER_MARK)[2][2:]


def adapted(adapter_names: Iterable[str]) -> Dict[str, List[Tuple[str, str]]]:
    """Each adapted weight of ours (``layers.3.attention.qkv.weight``) and its adapters' (A, B)
    names, one pair per segment in the fused order (q, k, v), or the one pair."""
    out: Dict[str, List[Tuple[str, str]]] = {}
    for name in adapter_names:
        layer, _, leaf = name.partition(ADAPTER_MARK)
        if is_down_projection(name):
            out.setdefault(layer + ".weight", []).append((name, f"{layer}{ADAPTER_MARK}b{leaf[1:]}"))
    order = {"": 0, **{s: i for i, s in enumerate(SEGMENTS)}}
    return {w: sorted(pairs, key=lambda pair: order[_segment(pair[0])]) for w, pairs in out.items()}


@dataclass(frozen=True)
class Adapters:
    """The adapters of the checkpoint ``path`` (named ``key=`` in messages), checked to fit a base."""

    path: str
    key: str
    shapes: Dict[str, List[int]]
    peft: PeftConfig
    tcfg: TransformerConfig  # the base model's, with these adapters

    @property
    def spec(self) -> LoRASpec:
        return self.tcfg.lora


def _with_peft(cfg: RunConfig, peft: PeftConfig, what: str) -> Tuple[RunConfig, Derived]:
    """``cfg`` in one process with the adapters of ``peft`` (``what``: their source, for messages)."""
    probe = copy.deepcopy(cfg)
    probe.peft = dataclasses.replace(peft, adapter=None)
    try:
        return standalone.single_process(probe)
    except ConfigError as e:
        raise ConfigError(f"{what} do not fit this base model: {e}") from None


def read_adapters(path: str, key: str, base: Optional[RunConfig] = None, verify: bool = True) -> Adapters:
    """The adapters of the checkpoint ``path`` (an adapter checkpoint, or a full one of a
    ``peft=lora`` run), checked against what its ``peft`` settings give the model of ``base``
    (default: its own config's model); its files' checksums too unless the caller has (``verify``)."""
    meta = store.validate(path, key)
    cfg = standalone.read_config(path)
    if cfg.peft.name != "lora":
        raise CheckpointError(f"{key}={path} holds no LoRA adapters (its config has peft={cfg.peft.name}): give a "
                              "checkpoint of a peft=lora run")
    _, derived = _with_peft(base or cfg, cfg.peft, f"the adapters of {key}={path}")
    expected = plan.logical_shapes(derived, "adapters")
    recorded = select_names(meta["shapes"], "adapters")
    for name in sorted(set(expected) | set(recorded)):
        there, here = recorded.get(name), expected.get(name)
        if there != here:
            found = "lacks it" if there is None else f"has it as {there}"
            needed = f"is {here}" if here is not None else "does not exist"
            raise CheckpointError(f"{key}={path}: adapter tensor {name} {needed} on this base model but the checkpoint "
                                  f"{found}: the adapters belong to another base model; give the one they were "
                                  "trained on")
    if verify:
        sharded.verify(path, torch.device("cpu"))
    return Adapters(path, key, expected, cfg.peft, derived.transformer)


class Merger:
    """W + scale * B A for the adapted weights of a base, each weight's adapters read when it is."""

    def __init__(self, adapters: Adapters, main: bool):
        self.adapters = adapters
        self.sources = standalone.tensor_sources(adapters.path, adapters.shapes, main=main)
        self.pairs = adapted(adapters.shapes)

    def __contains__(self, weight: str) -> bool:
        return weight in self.pairs

    def merge(self, weight: str, w: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        """The merged ``weight`` (``w``, our layout), computed in float32, or float64 when any of
        its inputs or ``out`` is: peft's order of operations, (B @ A) * scale, then the sum."""
        names = [n for pair in self.pairs[weight] for n in pair]
        read = dict(standalone.read_tensors(self.adapters.path, [self.sources[n] for n in names]))
        t = {n: read[self.sources[n][0]] for n in names}
        dtype = torch.float64 if torch.float64 in (w.dtype, out, *(x.dtype for x in t.values())) else torch.float32
        deltas = [(t[b].to(dtype) @ t[a].to(dtype)) * self.adapters.spec.scale for a, b in self.pairs[weight]]
        delta = fuse_qkv(*deltas, self.adapters.tcfg) if len(deltas) == len(SEGMENTS) else deltas[0]
        return w.to(dtype) + delta


# What to do instead, when an adapted weight has no peft form (``peft_modules``).
EXPORT_FIX = "export the merged model instead: input=<base checkpoint> adapter=<adapter checkpoint> merge=true"
IMPORT_FIX = "merge the adapter into the Hugging Face model with peft (merge_and_unload), then import that model"


def peft_modules(family, tcfg: TransformerConfig, weights: Iterable[str],
                 fix: str = EXPORT_FIX) -> Dict[str, List[str]]:
    """For each adapted weight of ours, the Hugging Face modules (``model.layers.3.self_attn.q_proj``)
    whose ``peft`` adapters its segments are; one line (ending in ``fix``) for a weight without."""
    wanted = set(weights)
    rules = {ours: (rule, theirs) for rule in family.NAME_MAP.rules if not rule.tied
             for ours, theirs in rule.instances(tcfg) if ours in wanted}
    out = {}
    for weight in sorted(wanted):
        rule, theirs = rules.get(weight, (None, ()))
        if rule is None or rule.transform not in (IDENTITY, QKV):
            held = " + ".join(theirs) or "nothing"
            raise ConfigError(f"the adapters of {weight} have no peft form in a Hugging Face {family.MODEL_TYPE} model "
                              f"(it holds that weight as {held}, not as one linear layer per adapter): {fix}")
        out[weight] = [name[:-len(".weight")] for name in theirs]
    return out


def _peft_keys(module: str) -> Tuple[str, str]:
    return f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def _settings(peft: PeftConfig, modules: Dict[str, List[str]]) -> peft_config.LoraSettings:
    names = sorted({_leaf(m) for mods in modules.values() for m in mods})
    return peft_config.LoraSettings(peft.rank, float(peft.alpha), float(peft.dropout), peft.rslora, names)


def export_peft(input: str, output: str, dtype: Optional[str], base: Optional[str]) -> Dict[str, object]:
    """Write the adapters of the checkpoint ``input`` as the ``peft`` adapter directory ``output``
    (tensors in ``dtype``, default their own; ``base``: the Hugging Face base it belongs to, recorded
    as ``base_model_name_or_path``)."""
    adapters = read_adapters(input, "input")
    family = family_for(adapters.tcfg)
    pairs = adapted(adapters.shapes)
    modules = peft_modules(family, adapters.tcfg, pairs)
    target = DTYPES[dtype] if dtype is not None else None
    sources = standalone.tensor_sources(input, adapters.shapes, main=target == torch.float32)
    keys, specs = {}, []
    for weight, segments in pairs.items():
        for (a, b), module in zip(segments, modules[weight]):
            for ours, theirs in zip((a, b), _peft_keys(module)):
                keys[sources[ours][0]] = theirs
                specs.append((theirs, adapters.shapes[ours], target or sources[ours][2]))
    dtypes = {name: written for name, _, written in specs}
    with staging.staged(output) as stage:
        peft_config.write(stage, _settings(adapters.peft, modules), base)
        with hf_files.ShardWriter(stage, specs, max_shard_bytes=math.inf) as out:  # one file: peft reads one
            for key, t in standalone.read_tensors(input, [sources[n] for n in adapters.shapes]):
                out.put(keys[key], t.to(dtypes[keys[key]]))
            [file] = out.finish()
        os.replace(os.path.join(stage, file), os.path.join(stage, ADAPTER_WEIGHTS))
    return {"architecture": f"peft LoRA adapter of a {family.MODEL_TYPE} model",
            "files": [peft_config.ADAPTER_CONFIG, ADAPTER_WEIGHTS]}


def _adapter_files(directory: str) -> hf_files.WeightFiles:
    files = hf_files.WeightFiles()
    for name, add in ((ADAPTER_WEIGHTS, files.add_safetensors), (ADAPTER_BIN, files.add_pickle)):
        if os.path.lexists(os.path.join(directory, name)):
            add(os.path.join(directory, name))
            return files
    raise CheckpointError(f"input={directory} has no {ADAPTER_WEIGHTS} (or {ADAPTER_BIN}): give a peft adapter "
                          "directory as save_pretrained writes it")


def _chosen(base: RunConfig, family, settings: peft_config.LoraSettings, path: str) -> Tuple[List[str], Set[str]]:
    """Our target layers for the modules ``settings`` names, and those modules' names (``q_proj``,
    ...; all of them for all-linear). An entry names modules as ``peft`` matches them, by suffix
    (``q_proj``, ``self_attn.q_proj``), and must match one of every layer's."""
    _, derived = _with_peft(base, PeftConfig(name="lora", rank=1, alpha=1.0), "adapters")
    weights = adapted(plan.logical_shapes(derived, "adapters"))
    target_of, paths = {}, {}
    for weight, modules in peft_modules(family, derived.transformer, weights, IMPORT_FIX).items():
        for module in modules:
            target_of[_leaf(module)] = weight.split(".")[-2]
            paths.setdefault(_leaf(module), []).append(module)
    leaves = set(paths) if settings.modules is None else set()
    for entry in settings.modules or ():
        found = paths.get(_leaf(entry))
        if not found or not all(p == entry or p.endswith("." + entry) for p in found):
            raise ConfigError(f"{path}: target_modules names {entry!r}, which is no module of every layer of this "
                              f"{family.MODEL_TYPE} base: supported are {', '.join(sorted(paths))}")
        leaves.add(_leaf(entry))
    return [t for t in LORA_TARGETS if t in {target_of[leaf] for leaf in leaves}], leaves


def _zeros(shape: List[int], dtype: torch.dtype) -> LazyTensor:
    return LazyTensor(tuple(shape), dtype, lambda: torch.zeros(shape, dtype=dtype))


def _read(files: hf_files.WeightFiles, name: str, shape: List[int]) -> LazyTensor:
    return LazyTensor(tuple(shape), files.dtypes[name], lambda: files[name])


def _import_tensors(input: str, files: hf_files.WeightFiles, shapes: Dict[str, List[int]],
                    modules: Dict[str, List[str]], leaves: Set[str]) -> Dict[str, LazyTensor]:
    """Our adapter tensors from the ``peft`` files, each checked from the headers before any is
    read; zeros for the q, k or v that the adapter leaves out. Every file tensor must be used."""
    out, used = {}, set()
    dtypes = [d for d in files.dtypes.values()]
    if not dtypes or not all(d.is_floating_point for d in dtypes):
        raise CheckpointError(f"input={input}: its adapter tensors are {sorted(set(map(str, dtypes))) or 'none'}: "
                              "floating-point tensors are needed; copy the adapter again")
    for weight, segments in adapted(shapes).items():
        for (a, b), module in zip(segments, modules[weight]):
            if _leaf(module) not in leaves:
                out[a], out[b] = _zeros(shapes[a], dtypes[0]), _zeros(shapes[b], dtypes[0])
                continue
            for ours, theirs in zip((a, b), _peft_keys(module)):
                if theirs not in files.shapes:
                    raise CheckpointError(f"input={input} has no tensor {theirs}, which its "
                                          f"{peft_config.ADAPTER_CONFIG} implies: the files do not belong together")
                if list(files.shapes[theirs]) != list(shapes[ours]):
                    raise CheckpointError(f"input={input}: tensor {theirs} has shape {list(files.shapes[theirs])} but "
                                          f"{list(shapes[ours])} on this base model: the adapter belongs to another "
                                          "base model (or another rank); give the one it was trained on")
                out[ours] = _read(files, theirs, shapes[ours])
                used.add(theirs)
    left = sorted(set(files.shapes) - used)
    if left:
        raise CheckpointError(f"input={input}: tensor {left[0]} has no place among our adapters of this base model "
                              "(only LoRA A and B of its target modules on every layer): not supported")
    return {name: out[name] for name in shapes}


def import_peft(input: str, base: Optional[str], output: str) -> PeftConfig:
    """Write the ``peft`` adapter directory ``input`` as an adapter checkpoint ``output`` of the base
    model in the checkpoint ``base``; returns its ``peft`` settings (stored in its config too)."""
    settings = peft_config.read(input)
    if base is None:
        raise ConfigError(f"input={input} is a peft adapter directory: give base=<checkpoint of its base model> (a "
                          "Hugging Face model imported with from_hf)")
    if store.adapter_only(store.validate(base, "base")):
        raise ConfigError(f"base={base} is an adapter checkpoint: give the full checkpoint of the base model")
    base_cfg = standalone.read_config(base)
    base_cfg.checkpoint.load = os.path.abspath(base)  # what the adapters were trained on, for messages
    family = family_for(standalone.single_process(base_cfg)[1].transformer)
    path = os.path.join(input, peft_config.ADAPTER_CONFIG)
    targets, leaves = _chosen(base_cfg, family, settings, path)
    peft = PeftConfig(name="lora", rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout,
                      target_modules=targets, rslora=settings.rslora)
    cfg, derived = _with_peft(base_cfg, peft, f"the adapters of {path}")
    shapes = plan.logical_shapes(derived, "adapters")
    modules = peft_modules(family, derived.transformer, adapted(shapes), IMPORT_FIX)
    tensors = _import_tensors(input, _adapter_files(input), shapes, modules, leaves)
    with staging.staged(output) as stage:
        write_adapters(stage, tensors, cfg, derived)
    return peft


def write_adapters(path: str, tensors: Mapping[str, LazyTensor], cfg: RunConfig, derived: Derived) -> None:
    """Write ``tensors`` (every adapter of the model ``derived`` describes, by logical name) as an
    adapter checkpoint into the empty directory ``path``, one tensor at a time, each in the dtype
    it is made in; ``cfg`` (the base's model, ``peft=lora``) is stored with them."""
    standalone.save_tensors(path, tensors, cfg, derived, select="adapters")
