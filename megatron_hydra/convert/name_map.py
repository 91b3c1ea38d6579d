"""One declarative name map per model family, walked in both directions.

A family (``convert/gpt2.py``, ``llama.py``, ``bert.py``, ``t5.py``) lists rules (``Rule``): our
tensor name, the Hugging Face name(s), and the ``Transform`` between them when it is not the
identity. ``{i}`` in a name is a layer index, over ``range(getattr(cfg, rule.per))``, and ``{e}``
an expert index, over ``range(cfg.moe.num_experts)``; ``rule.when(cfg)`` says whether the tensor
exists in this variant (biases, a gated MLP, an untied head, ...). The same table drives both
directions, and every transform is a pair of exact inverses, so they cannot drift apart.

Each direction is one walk that reads no tensor, since a whole-model conversion would need the
model in memory twice over (an 8B model in bf16 is 16 GB; people convert on 24 GiB or less):
``import_tensors`` gives each of our logical tensors as a ``LazyTensor`` (its shape and dtype from
the files' headers through its transform on the meta device) that reads its sources (a fused
QKV: q, k and v of one layer) only when a checkpoint writer reaches it; ``export_plan`` lists
what each of our tensors becomes, so that an export reads them a few at a time into planned
shards. Every name, shape and count is checked before the first tensor is read.
``import_weights`` / ``export_weights`` are the same walks made eager, for small models.

The Hugging Face shapes that an import checks are written nowhere: they are our model's logical
shapes sent through the export direction on the meta device, so a ``config.json`` that does not
match its weights still fails in one line naming the tensor. ``check_files`` does this from the
files' headers before the model is built, with the shapes of the model cut to its first layers
(``first_layers``): a config that claims far more layers or experts than its files hold costs
nothing to refuse.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch

from megatron_hydra.checkpoint.lazy_write import LazyTensor
from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert.mapping import HFWeights, fuse_kv, fuse_qkv, split_kv, split_qkv
from megatron_hydra.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class Transform:
    """``to_ours(*theirs, cfg)`` -> our tensor, and its exact inverse ``to_theirs(ours, cfg)`` ->
    their tensors, in the order of ``Rule.theirs``."""

    to_ours: Callable[..., torch.Tensor]
    to_theirs: Callable[[torch.Tensor, TransformerConfig], Tuple[torch.Tensor, ...]]


IDENTITY = Transform(lambda t, cfg: t, lambda t, cfg: (t,))
# A Conv1D (GPT-2) stores [in, out], the transpose of a linear layer's weight.
TRANSPOSE = Transform(lambda t, cfg: t.t(), lambda t, cfg: (t.t(),))
# Separate q, k, v projections <-> our QKV fused per query group (mapping.fuse_qkv).
QKV = Transform(lambda q, k, v, cfg: fuse_qkv(q, k, v, cfg), split_qkv)
# Separate k, v projections <-> our cross-attention KV fused per query group (mapping.fuse_kv).
KV = Transform(lambda k, v, cfg: fuse_kv(k, v, cfg), split_kv)


def always(cfg: TransformerConfig) -> bool:
    return True


def tied(cfg: TransformerConfig) -> bool:
    return cfg.tie_embeddings


def untied(cfg: TransformerConfig) -> bool:
    return not cfg.tie_embeddings


def biased(cfg: TransformerConfig) -> bool:
    return cfg.add_bias_linear


@dataclass(frozen=True)
class Rule:
    """Our tensor ``ours`` is the Hugging Face tensor(s) ``theirs`` through ``transform``.

    ``tied``: ``theirs`` is the same tensor as another rule's (an output head tied to the word
    embedding): written when a full state dict is asked for, as ``transformers`` holds it, left out
    of files, as ``save_pretrained`` does, and on import checked when present, then skipped."""

    ours: str
    theirs: Union[str, Tuple[str, ...]]
    transform: Transform = IDENTITY
    per: Optional[str] = None  # the TransformerConfig field that counts the layers {i} runs over
    when: Callable[[TransformerConfig], bool] = always
    tied: bool = False
    # (cfg, layer) -> whether layer {i} holds this tensor, where layers differ (MoE and dense).
    only: Optional[Callable[[TransformerConfig, int], bool]] = None

    def instances(self, cfg: TransformerConfig) -> Iterator[Tuple[str, Tuple[str, ...]]]:
        """(our name, their names) for every layer (and expert) this rule covers in ``cfg``."""
        for _, ours, theirs in self.indexed(cfg):
            yield ours, theirs

    def indexed(self, cfg: TransformerConfig) -> Iterator[Tuple[str, str, Tuple[str, ...]]]:
        """(our name in the first layer this rule covers, our name, their names), lazily: a config
        may claim more layers than any file holds."""
        if not self.when(cfg):
            return
        theirs = (self.theirs,) if isinstance(self.theirs, str) else self.theirs
        layers = range(getattr(cfg, self.per)) if self.per is not None else [None]
        if self.only is not None:
            layers = (i for i in layers if self.only(cfg, i))
        experts = range(cfg.moe.num_experts) if "{e}" in self.ours else [None]
        first_layer = None
        for i in layers:  # a loop, not itertools.product, which would list every layer first
            first_layer = i if first_layer is None else first_layer
            for e in experts:
                yield _fill(self.ours, first_layer, e), _fill(self.ours, i, e), tuple(_fill(t, i, e) for t in theirs)


def _fill(name: str, layer: Optional[int], expert: Optional[int]) -> str:
    return name.replace("{i}", str(layer)).replace("{e}", str(expert))


def weight_and_bias(ours: str, theirs: str, per: Optional[str] = None, bias: Callable = always,
                    when: Callable = always) -> Tuple[Rule, Rule]:
    """``.weight`` and (where ``bias(cfg)``) ``.bias`` of a layer stored alike on both sides."""
    return (Rule(f"{ours}.weight", f"{theirs}.weight", per=per, when=when),
            Rule(f"{ours}.bias", f"{theirs}.bias", per=per, when=lambda cfg: when(cfg) and bias(cfg)))


@dataclass(frozen=True)
class NameMap:
    """A family's whole table. ``ignored``: suffixes of tensors in Hugging Face files that an
    import leaves out (buffers older files carry; heads the imported variant has no place for).
    ``optional_prefix``: the full model's names start with it, the bare model's (``GPT2Model``
    rather than ``GPT2LMHeadModel``) do not."""

    family: str  # Hugging Face model_type, for messages
    rules: Tuple[Rule, ...]
    ignored: Tuple[str, ...] = ()
    optional_prefix: str = ""


def their_shapes(rule: Rule, ours: str, shapes: Mapping[str, List[int]], cfg: TransformerConfig) -> List[List[int]]:
    """The Hugging Face shapes of our tensor ``ours``: its shape sent through the export direction
    on the meta device."""
    meta = torch.empty(shapes[ours], device="meta")
    return [list(t.shape) for t in rule.transform.to_theirs(meta, cfg)]


def their_name(name_map: NameMap, weights: HFWeights) -> Callable[[str], str]:
    """A name of the table as the files spell it: without ``optional_prefix`` in a bare model's."""
    prefix = name_map.optional_prefix
    bare = bool(prefix) and not any(n.startswith(prefix) for n in weights.shapes)
    return lambda name: name[len(prefix):] if bare and name.startswith(prefix) else name


def _first_of_each(flags: List[int]) -> List[int]:
    return [flags.index(kind) for kind in (0, 1) if kind in flags]


def first_layers(model: ModelConfig) -> ModelConfig:
    """``model`` cut to the fewest leading layers that still hold a layer of each kind whose
    tensors differ (MoE and dense; T5's decoder to one layer), its per-layer lists cut alike: the
    model ``check_files`` takes the expected shapes from. The sliding window goes, since windowed
    layers hold the same tensors as the rest, and a cut pattern might leave none windowed."""
    freq = model.moe.layer_freq if model.moe is not None else 1
    if isinstance(freq, int) and not isinstance(freq, bool):
        flags = [int(i % freq == 0) for i in range(min(model.num_layers, freq + 1))]
    else:
        flags = [int(f) for f in freq]
    keep = min(model.num_layers, 1 + max(_first_of_each(flags), default=0))
    cut = dataclasses.replace(model, num_layers=keep, sliding_window=None, sliding_window_pattern=1,
                              local_rope_theta=None)
    if model.moe is not None and not isinstance(freq, int):
        cut.moe = dataclasses.replace(model.moe, layer_freq=flags[:keep])
    if model.num_decoder_layers is not None:
        cut.num_decoder_layers = min(model.num_decoder_layers, 1)
    return cut


def check_files(name_map: NameMap, weights: HFWeights, cfg: TransformerConfig,
                first_layer: Callable[[], Tuple[TransformerConfig, Dict[str, List[int]]]]) -> None:
    """Before the model of ``cfg`` is built: the files hold every tensor its config implies, in its
    shape, and nothing else (``name_map.ignored`` aside); only names and shapes are looked at.

    Names are walked lazily, so a ``config.json`` that claims 100000 layers (or experts) over files
    that hold two fails at the third, before anything of that size is built. The shapes then come
    from ``first_layer()``: the same model cut to its first layers (``first_layers``) and its
    logical shapes, since every layer of one kind has the same shapes."""
    hf = their_name(name_map, weights)
    for rule in name_map.rules:
        for _, _, theirs in rule.indexed(cfg):
            for name in theirs:
                if not rule.tied and hf(name) not in weights:
                    weights.check(hf(name), ())  # the one-line error that names the missing tensor
    first, first_shapes = first_layer()
    seen, expected = set(), {}
    for number, rule in enumerate(name_map.rules):
        for mine, _, theirs in rule.indexed(cfg):
            if (number, mine) not in expected:
                if mine not in first_shapes:
                    raise CheckpointError(f"input={weights.source}: converted tensor {mine} has no place in the model")
                expected[number, mine] = their_shapes(rule, mine, first_shapes, first)
            for name, shape in zip(theirs, expected[number, mine]):
                if not rule.tied or hf(name) in weights:
                    weights.check(hf(name), shape)
                    seen.add(hf(name))
    leftover = weights.unused(name_map.ignored, used=seen)
    if leftover:
        raise CheckpointError(f"input={weights.source}: tensor {leftover[0]} has no place in a {name_map.family} "
                              "model of this config; this variant is not supported")


def import_tensors(name_map: NameMap, weights: HFWeights, cfg: TransformerConfig, shapes: Mapping[str, List[int]],
                   order: Optional[Callable[[str], int]] = None) -> Dict[str, LazyTensor]:
    """Our logical tensors (the model's ``shapes``, vocabulary unpadded) as ``LazyTensor``s that
    read the Hugging Face tensors ``weights`` when made, each in the dtype its transform gives the
    files' own. Every tensor of the model must come from the table and every tensor of the files
    go into it (``name_map.ignored`` aside); a tied copy is checked, then left. All of this is
    checked before anything is read. With ``order(hf_name)`` (the file a tensor is in) the tensors
    are ordered by their sources, so that a writer reads each file once, in turn."""
    source, hf = weights.source, their_name(name_map, weights)
    out: Dict[str, Tuple[tuple, LazyTensor]] = {}
    for rule in name_map.rules:
        for ours, theirs in rule.instances(cfg):
            if ours not in shapes:
                raise CheckpointError(f"input={source}: converted tensor {ours} has no place in the model")
            names = [hf(name) for name in theirs]
            expected = their_shapes(rule, ours, shapes, cfg)
            present = [(n, s) for n, s in zip(names, expected) if not rule.tied or n in weights]
            for name, shape in present:
                weights.check(name, shape)
                weights.used.add(name)
            if rule.tied:
                continue
            made = rule.transform.to_ours(*(torch.empty(s, dtype=weights.dtypes[n], device="meta")
                                            for n, s in present), cfg)
            key = tuple(sorted(order(n) for n in names)) if order is not None else ()
            out[ours] = key, LazyTensor(tuple(shapes[ours]), made.dtype, _reader(rule, present, weights, cfg))
    missing = [name for name in shapes if name not in out]
    if missing:
        raise CheckpointError(f"input={source}: nothing maps to our tensor {missing[0]}; this variant of the "
                              "architecture is not supported")
    leftover = weights.unused(name_map.ignored)
    if leftover:
        raise CheckpointError(f"input={source}: tensor {leftover[0]} has no place in a {name_map.family} model of "
                              "this config; this variant is not supported")
    ranked = sorted(out.items(), key=lambda item: item[1][0])  # stable: the table's order within a file
    return {name: lazy for name, (_, lazy) in ranked}


def _reader(rule: Rule, sources: List[Tuple[str, List[int]]], weights: HFWeights, cfg: TransformerConfig):
    def make() -> torch.Tensor:
        return rule.transform.to_ours(*(weights.take(name, shape) for name, shape in sources), cfg)
    return make


def import_weights(name_map: NameMap, weights: HFWeights, cfg: TransformerConfig,
                   shapes: Mapping[str, List[int]]) -> Dict[str, torch.Tensor]:
    """``import_tensors``, every tensor made at once: for a model small enough to hold twice."""
    return {name: lazy.make() for name, lazy in import_tensors(name_map, weights, cfg, shapes).items()}


Step = Tuple[str, Rule, Tuple[str, ...]]


def export_plan(name_map: NameMap, cfg: TransformerConfig, shapes: Mapping[str, List[int]],
                dtypes: Mapping[str, torch.dtype], with_tied: bool = False) -> Tuple[List[Step], list]:
    """What an export writes, before any tensor is read: (our name, rule, their names) for each of
    our logical tensors that goes into the files, in the table's order, and (their name, shape,
    dtype) for each Hugging Face tensor, ``dtypes[ours]`` being the dtype it is written in. Tied
    copies are left out unless ``with_tied``, as ``save_pretrained`` leaves them out of files."""
    steps, specs, used = [], [], set()
    for rule in name_map.rules:
        for ours, theirs in rule.instances(cfg):
            used.add(ours)
            if ours not in shapes:
                raise ConfigError(f"this model has no tensor {ours}, which a Hugging Face {name_map.family} model "
                                  "needs: this variant cannot be exported")
            if rule.tied and not with_tied:
                continue
            steps.append((ours, rule, theirs))
            specs += [(name, shape, dtypes[ours]) for name, shape in zip(theirs, their_shapes(rule, ours, shapes, cfg))]
    extra = sorted(set(shapes) - used)
    if extra:
        raise ConfigError(f"our tensor {extra[0]} has no place in a Hugging Face {name_map.family} model: "
                          "this variant cannot be exported")
    return steps, specs


def export_weights(name_map: NameMap, state: Mapping[str, torch.Tensor], cfg: TransformerConfig,
                   with_tied: bool = True) -> Dict[str, torch.Tensor]:
    """A Hugging Face state dict from our logical tensors (vocabulary unpadded), by ``export_plan``.
    ``with_tied``: include the tied copies, as the model's ``state_dict()`` does; files leave them out."""
    shapes = {name: list(t.shape) for name, t in state.items()}
    steps, _ = export_plan(name_map, cfg, shapes, {name: t.dtype for name, t in state.items()}, with_tied)
    out: Dict[str, torch.Tensor] = {}
    for ours, rule, theirs in steps:
        out.update(zip(theirs, rule.transform.to_theirs(state[ours], cfg)))
    return out
