"""Import a Hugging Face model directory as a checkpoint, and export a checkpoint back.

The families are listed in ``convert.families`` (one module each with its name map,
``convert.name_map``). Import dispatches on ``config.json``'s ``model_type``; export on the
checkpoint's ``model.arch``, then (for GPT) on which Hugging Face family the model fits.
Checkpoint tensors are logical (``backends.logical_parameters``): one per expert of an MoE layer,
whose experts the model stacks in one parameter.

Import writes a weights-only checkpoint (``checkpoint.standalone``) that any layout loads, since
checkpoints are layout-free: ``parallel`` only checks that the model splits that way and goes
into the printed command. The model's config is stored in the checkpoint's ``meta.json``, which
``launch.py model=from_checkpoint checkpoint.load=<output>`` reads as data: a checkpoint is data,
never a Hydra config search path (a YAML file there could declare Hydra callbacks, which Hydra
runs). Beside the tensors go the model's ``tokenizer.json`` (with its ``tokenizer_config.json``,
which holds the chat template) when it has one: regular files only, of bounded size, and a link
only when it stays in the model directory or, in a Hugging Face cache snapshot, leads to the
repository's ``blobs``. Vocabulary tables are stored unpadded, as every checkpoint stores them;
each run pads them to its own TP multiple.

The weights' names and shapes are checked against ``config.json`` from the files' headers before
anything is built or read, and its layer and expert counts against the number of tensors the files
hold before anything is built from them, so a config that claims 100000 layers is one line at
once, not minutes of building.

LoRA adapters (``convert.lora``) go out merged into the weights (``merge``) or as a ``peft``
adapter directory, and come in from one as an adapter checkpoint of an imported base.

Both directions stream (``name_map.import_tensors``, ``export_plan``): one tensor at a time, never
the whole model, each tensor in the dtype it has (an import keeps its files' dtype; an export writes the checkpoint's
own unless ``dtype`` says otherwise). Export writes ``config.json`` plus safetensors that
``transformers``' ``from_pretrained`` reads, tied copies left out (as ``save_pretrained`` leaves
them out). Either writes into a hidden sibling directory renamed to ``output`` at the end
(``convert.staging``): a failed conversion leaves no partial output.
"""

from __future__ import annotations

import copy
import math
import os
import re
from typing import Dict, List, Optional

import torch

from megatron_hydra import untrusted
from megatron_hydra.checkpoint import plan, sharded, standalone, store
from megatron_hydra.checkpoint.lazy_write import LazyTensor
from megatron_hydra.config import RunConfig, bundled, derive
from megatron_hydra.config.derive import DTYPES
from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.convert import hf_files, lora, name_map, peft_config, staging
from megatron_hydra.convert.families import FAMILIES, family_for
from megatron_hydra.convert.mapping import HFConfig, HFWeights
from megatron_hydra.errors import CheckpointError, ConfigError, MegatronHydraError
from megatron_hydra.models.archs import ARCHS
from megatron_hydra.parallel.state import ParallelState

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_BYTES, TOKENIZER_CONFIG_BYTES = 512 * untrusted.MiB, 16 * untrusted.MiB  # far above real ones
CORPUS_PLACEHOLDER = "path/to/corpus_text_document"  # BERT and T5 train on sentence-split data


def composed_config(parallel: str, arch: str) -> RunConfig:
    """conf/ composed as ``launch.py`` would for ``parallel=<parallel>`` (and, for BERT and T5,
    the data preset they train on)."""
    known = bundled.group_options("parallel")
    if parallel not in known:
        raise ConfigError(f"parallel={parallel}: no such layout; use one of {', '.join(known)}")
    return bundled.compose([f"parallel={parallel}", *([f"data=indexed_{arch}"] if arch != "gpt" else [])])


def check_layout(cfg: RunConfig) -> None:
    """The model must split over the layout ``cfg.parallel`` names (derive's checks, with a
    batch any pipeline accepts)."""
    probe = copy.deepcopy(cfg)
    par = probe.parallel
    probe.trainer.devices = par.tensor_parallel_size * par.pipeline_parallel_size
    probe.data.micro_batch_size = 1
    probe.data.global_batch_size = par.pipeline_parallel_size * (par.virtual_pipeline_size or 1) * 2
    derive(probe)


def default_name(hf_dir: str) -> str:
    base = os.path.basename(os.path.normpath(hf_dir)).lower()
    return re.sub(r"[^a-z0-9_]+", "_", base).strip("_") or "imported"


def from_hf(input: str, output: str, parallel: str = "single", name: Optional[str] = None,
            base: Optional[str] = None) -> str:
    """Import the Hugging Face model directory ``input`` into a checkpoint at ``output``, or the
    ``peft`` adapter directory ``input`` into an adapter checkpoint of the checkpoint ``base``
    (``convert.lora``); returns the command that fine-tunes it."""
    if os.path.lexists(os.path.join(input, peft_config.ADAPTER_CONFIG)):
        return _from_peft(input, output, parallel, base)
    if base is not None:
        raise ConfigError(f"base={base} goes with a peft adapter directory, and input={input} has no "
                          f"{peft_config.ADAPTER_CONFIG}: drop base= to import a model")
    hf = hf_files.read_config(input)
    kind = hf.value("model_type", str, None)
    if kind not in FAMILIES:
        names = ", ".join(map(str, hf.value("architectures", list, [])))
        raise ConfigError(f"input={input}: model_type={kind!r} ({names}) is not "
                          f"supported: supported are {', '.join(FAMILIES)}")
    check_output(output)
    name = name or default_name(input)
    family = FAMILIES[kind]
    files = hf_files.read_weights(input)
    _check_counts(hf, files)
    composed = composed_config(parallel, family.ARCH)
    cfg = RunConfig(model=family.model_config(hf, name), parallel=composed.parallel, run_dir="unused")
    if family.ARCH != "gpt":
        cfg.data = composed.data
    check_layout(cfg)
    extras = _read(_tokenizer_paths(input, _link_roots(input), "model directory"))
    if TOKENIZER in extras:
        cfg.data.tokenizer = TokenizerConfig(type="hf", path=os.path.join(os.path.abspath(output), TOKENIZER))
    cfg, derived = standalone.single_process(cfg)
    cfg.parallel = composed.parallel  # recorded as the intended layout; loading ignores it
    tensors = _import_tensors(family, input, files, cfg, derived)
    with staging.staged(output) as stage:
        standalone.save_tensors(stage, tensors, cfg, derived, files=extras)
    return fine_tune_command(cfg, output, parallel)


def check_output(output: str) -> None:
    """``output`` is new or an empty directory (a conversion never writes over anything)."""
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ConfigError(f"output={output} already exists and is not empty: choose a new directory")


def _from_peft(input: str, output: str, parallel: str, base: Optional[str]) -> str:
    """The ``peft`` adapter directory ``input`` as an adapter checkpoint of ``base``; returns the
    command that goes on training it (the adapters' settings spelled out, as the run needs them)."""
    check_output(output)
    if not bundled.has_option("parallel", parallel):
        composed_config(parallel, "gpt")  # the one line listing the layouts
    peft = lora.import_peft(input, base, output)
    par = composed_config(parallel, "gpt").parallel  # after the import: composing costs a second
    settings = (f"peft=lora peft.adapter={output} peft.rank={peft.rank} peft.alpha={peft.alpha} "
                f"peft.dropout={peft.dropout} peft.rslora={str(peft.rslora).lower()} "
                f"peft.target_modules=[{','.join(peft.target_modules)}]")
    return (f"python launch.py model=from_checkpoint checkpoint.load={base} checkpoint.load_optimizer=false "
            f"parallel={parallel} trainer.devices={par.tensor_parallel_size * par.pipeline_parallel_size} {settings}")


# The config.json keys that count layers or experts, in every family (GPT-2: n_layer; T5:
# num_layers, num_decoder_layers; Mixtral: num_local_experts; Qwen3-MoE: num_experts).
COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "num_experts", "num_local_experts")


def _check_counts(hf: HFConfig, files: hf_files.WeightFiles) -> None:
    """Every layer and every expert holds at least one tensor, so a count in ``config.json`` above
    the number of tensors the files hold is refused before anything is built from it: families
    build per-layer lists (window and MoE flags) and derive per-layer tuples, all of a claimed
    count's size, before the files' names are checked. Counts of the wrong type are left to the
    family's typed reads."""
    held = len(files.shapes)
    for key in COUNT_KEYS:
        count = hf.get(key)
        if isinstance(count, int) and not isinstance(count, bool) and count > held:
            raise CheckpointError(f"{hf.path}: {key}={count}, but the weights beside it hold only {held} tensors: "
                                  "the weights and config.json do not belong together")


def _import_tensors(family, input: str, files: hf_files.WeightFiles, cfg: RunConfig,
                    derived) -> Dict[str, LazyTensor]:
    """Our logical tensors of the directory ``input`` (its weight ``files``), each read when the
    checkpoint writer reaches it. The files' names and shapes are checked against the config
    first, from their headers alone, with the model cut to its first layers; only then are the
    whole model's logical tensors listed (from a model on the meta device), so a config.json that
    claims far more than its files hold costs nothing."""
    tcfg = derived.transformer
    weights = HFWeights(files, input, files.shapes, files.dtypes)
    name_map.check_files(family.NAME_MAP, weights, tcfg, lambda: _first_layer(cfg))
    shapes = plan.logical_shapes(derived)
    return name_map.import_tensors(family.NAME_MAP, weights, tcfg, shapes, files.file_of)


def _first_layer(cfg: RunConfig):
    """The model of ``cfg`` cut to its first layers (``name_map.first_layers``: one of each kind),
    on the meta device, and its logical shapes: what ``name_map.check_files`` compares the files'
    shapes with before the whole model is built."""
    first = copy.deepcopy(cfg)
    first.model = name_map.first_layers(first.model)
    tcfg = standalone.single_process(first)[1].transformer
    model = ARCHS[tcfg.arch].build(tcfg, ParallelState.single(), device="meta")
    return tcfg, sharded.logical_shapes(model, 1, tcfg.vocab_size)


def _within(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _link_roots(directory: str) -> List[str]:
    """Where a link in the model directory may lead: the directory itself, and, for a snapshot of
    a Hugging Face cache (``<repo>/snapshots/<revision>/``, its files links to
    ``../../blobs/<hash>``), that repository's ``blobs`` folder."""
    real = os.path.realpath(directory)
    roots = [real]
    repo = os.path.dirname(os.path.dirname(real))
    if os.path.basename(os.path.dirname(real)) == "snapshots" and os.path.isdir(os.path.join(repo, "blobs")):
        roots.append(os.path.join(repo, "blobs"))
    return roots


def _confined(directory: str, name: str, roots: List[str], what: str) -> Optional[str]:
    """The path of the file ``name`` of ``directory`` (the ``what``), or None when there is none; a
    link must lead inside one of ``roots``.

    A model directory or a checkpoint comes from anyone, and what is copied from it lands in a
    checkpoint or model that may be shared: a link to a file elsewhere (a key, a password file)
    would copy that file along."""
    path = os.path.join(directory, name)
    if not os.path.lexists(path):
        return None
    target = os.path.realpath(path)
    if not any(_within(target, root) for root in roots):
        raise CheckpointError(f"{path} is a link to {target}, outside the {what}: refused (copy the file itself "
                              f"into the {what})")
    return path


def _tokenizer_paths(directory: str, roots: List[str], what: str) -> Dict[str, str]:
    """The ``tokenizer.json`` of ``directory`` and, beside it, its ``tokenizer_config.json`` (which
    holds the chat template ``data=sft`` renders with), by name, where present: what a conversion
    copies, each confined to ``roots`` (``_confined``)."""
    out = {}
    tokenizer = _confined(directory, TOKENIZER, roots, what)
    if tokenizer is not None:
        out[TOKENIZER] = tokenizer
        settings = _confined(directory, TOKENIZER_CONFIG, roots, what)
        if settings is not None:
            out[TOKENIZER_CONFIG] = settings
    return out


def _read(paths: Dict[str, str]) -> Dict[str, bytes]:
    """The content of each of ``paths`` (``_tokenizer_paths``): a regular file of bounded size."""
    limits = {TOKENIZER: TOKENIZER_BYTES, TOKENIZER_CONFIG: TOKENIZER_CONFIG_BYTES}
    return {name: untrusted.read_bytes(path, limits[name], name, CheckpointError) for name, path in paths.items()}


def fine_tune_command(cfg: RunConfig, output: str, parallel: str, load_optimizer: bool = False) -> str:
    """``launch.py`` continuing from the import: ``model=from_checkpoint`` reads the model from the
    checkpoint's own config, as data (a checkpoint is never a config search path). BERT and T5
    need their sentence-split corpus (``data.blend``), which the user puts in place of the
    placeholder. ``load_optimizer``: the import carries optimizer state, which the run loads."""
    par = cfg.parallel
    devices = par.tensor_parallel_size * par.pipeline_parallel_size
    fresh = "" if load_optimizer else " checkpoint.load_optimizer=false"
    command = (f"python launch.py model=from_checkpoint checkpoint.load={output}{fresh} "
               f"parallel={parallel} trainer.devices={devices}")
    if cfg.model.arch == "gpt":
        return command
    data = f" data={cfg.data.name} data.blend=[{CORPUS_PLACEHOLDER}]"
    if cfg.data.tokenizer.type == "hf":
        data += f" data.tokenizer.type=hf data.tokenizer.path={cfg.data.tokenizer.path}"
    return command + data


def _tokenizer_source(path: str, cfg: RunConfig):
    """The checkpoint's Hugging Face tokenizer (tokenizer.json), if it has one."""
    from megatron_hydra.data.tokenizers import HFTokenizer

    try:
        tokenizer = standalone.tokenizer_for(path, cfg)
    except MegatronHydraError:  # e.g. the training corpus is gone: export the weights anyway
        return None
    return tokenizer if isinstance(tokenizer, HFTokenizer) else None


EXPORT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def to_hf(input: str, output: str, dtype: Optional[str] = None,
          max_shard_bytes: int = hf_files.DEFAULT_SHARD_BYTES, adapter: Optional[str] = None, merge: bool = False,
          base: Optional[str] = None) -> Dict[str, object]:
    """Export the checkpoint ``input`` as a Hugging Face model directory ``output``, its tensors
    in ``dtype`` (default: the dtype the checkpoint holds them in). A float32 export of a 16-bit
    run takes its fp32 main weights where the checkpoint has them, as loading an fp32 model does.

    LoRA (``convert.lora``): with ``merge`` the adapters of ``adapter`` (default: ``input``'s own)
    are folded into the weights; a checkpoint holding adapters, exported without ``merge``, becomes
    a ``peft`` adapter directory of the Hugging Face model ``base`` (a name or directory, recorded)."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype={dtype}: use {', '.join(EXPORT_DTYPES)} (default: the checkpoint's own)")
    check_output(output)
    adapter_only = store.adapter_only(store.validate(input, "input"))
    own = adapter_only or standalone.read_config(input).peft.name == "lora"
    if own and not merge:
        if adapter is not None:
            raise ConfigError(f"adapter={adapter} goes with merge=true and a base input=: input={input} holds "
                              "adapters itself, which are written as a peft adapter directory")
        return lora.export_peft(input, output, dtype, base)
    _check_merge(input, adapter, merge, base, adapter_only, own)
    return _export_model(input, output, dtype, max_shard_bytes, (adapter or input) if merge else None)


def _check_merge(input: str, adapter: Optional[str], merge: bool, base: Optional[str], adapter_only: bool,
                 own: bool) -> None:
    """The arguments of a model export, merged or not, make sense together."""
    if base is not None:
        raise ConfigError(f"base={base} names the Hugging Face base of a peft adapter directory, which an export "
                          "of adapters without merge=true writes: drop base=")
    if adapter_only:
        raise ConfigError(f"merge=true folds adapters into a base model, and input={input} holds adapters only: "
                          f"give input=<base checkpoint> adapter={input}")
    if adapter is not None and not merge:
        raise ConfigError(f"adapter={adapter} is folded into input= with merge=true; for a peft adapter directory "
                          f"give input={adapter} alone")
    if adapter is not None and own:
        raise ConfigError(f"input={input} holds adapters of its own: merge them (merge=true without adapter=), or "
                          "give a base checkpoint without adapters")
    if merge and not own and adapter is None:
        raise ConfigError(f"merge=true: input={input} holds no adapters; give adapter=<adapter checkpoint>")


def _export_model(input: str, output: str, dtype: Optional[str], max_shard_bytes: int,
                  adapters: Optional[str]) -> Dict[str, object]:
    """The Hugging Face model directory of the checkpoint ``input``, with the adapters of the
    checkpoint ``adapters`` merged when given."""
    cfg, derived = standalone.checked_config(input, archs=tuple(ARCHS))
    own = _tokenizer_paths(input, [os.path.realpath(input)], "checkpoint")  # an import's; before anything is written
    tcfg = derived.transformer
    family = family_for(tcfg)
    sharded.verify(input, torch.device("cpu"))
    target = DTYPES[dtype] if dtype is not None else None
    shapes = plan.logical_shapes(derived, "base")
    merger = None
    if adapters is not None:
        found = lora.read_adapters(adapters, "adapter" if adapters != input else "input", cfg, verify=adapters != input)
        merger = lora.Merger(found, main=target == torch.float32)
    sources = standalone.tensor_sources(input, shapes, main=target == torch.float32)
    dtypes = {name: target or stored for name, (_, _, stored) in sources.items()}
    steps, specs = name_map.export_plan(family.NAME_MAP, tcfg, shapes, dtypes)
    config = {**family.hf_config(tcfg), **dict.fromkeys(("dtype", "torch_dtype"), _main_dtype(specs))}
    tokenizer = _tokenizer_source(input, cfg)
    if tokenizer is not None and family.ARCH == "gpt":  # a causal LM starts and ends at end-of-document
        config.update(bos_token_id=tokenizer.eod, eos_token_id=tokenizer.eod)
    with staging.staged(output) as stage:
        hf_files.write_config(stage, config)
        files = [hf_files.CONFIG, *_write_weights(input, stage, steps, specs, sources, tcfg, max_shard_bytes, merger)]
        for name, content in _tokenizer_files(own, tokenizer).items():
            with open(os.path.join(stage, name), "wb") as f:
                f.write(content)
            files.append(name)
    return {"architecture": family.MODEL_TYPE, "files": files}


def _write_weights(input: str, directory: str, steps, specs, sources, tcfg, max_shard_bytes: int,
                   merger: Optional[lora.Merger] = None) -> List[str]:
    """The safetensors shards of ``specs``: each of our tensors read from the checkpoint
    ``input`` (a few at a time), its adapters merged into it (``merger``), sent through its rule's
    inverse transform and written into its place; returns the files written."""
    dtypes = {name: dtype for name, _, dtype in specs}
    with hf_files.ShardWriter(directory, specs, max_shard_bytes) as out:
        step = {sources[ours][0]: (ours, rule, theirs) for ours, rule, theirs in steps}
        for key, t in standalone.read_tensors(input, [sources[ours] for ours, _, _ in steps]):
            ours, rule, theirs = step[key]
            if merger is not None and ours in merger:
                t = merger.merge(ours, t, dtypes[theirs[0]])
            _put(out, theirs, rule.transform.to_theirs(t, tcfg), dtypes)
            del t  # released before the next read, not after it
        return out.finish()


def _put(out: hf_files.ShardWriter, names, tensors, dtypes: Dict[str, torch.dtype]) -> None:
    for name, t in zip(names, tensors):
        out.put(name, t.to(dtypes[name]))


def _main_dtype(specs) -> str:
    """The dtype most of the exported bytes are in, as ``config.json`` names it."""
    sizes: Dict[torch.dtype, int] = {}
    for _, shape, dtype in specs:
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape) * dtype.itemsize
    return str(max(sizes, key=sizes.get)).replace("torch.", "")


def _tokenizer_files(own: Dict[str, str], tokenizer) -> Dict[str, bytes]:
    """What an export copies beside the weights: the checkpoint's ``own`` tokenizer files (an
    import's ``tokenizer.json`` with its ``tokenizer_config.json``, the chat template), else the
    ``tokenizer.json`` of the run's tokenizer (``data.tokenizer.path``)."""
    if tokenizer is None:
        return {}
    if TOKENIZER in own:
        return _read(own)
    return {TOKENIZER: untrusted.read_bytes(tokenizer.path, TOKENIZER_BYTES, TOKENIZER, CheckpointError)}
