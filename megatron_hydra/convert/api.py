"""Import a Hugging Face model directory as a checkpoint, and export a checkpoint back.

The families are GPT-2, Llama and Mixtral (our GPT), BERT and T5, one module each with its name map
(``convert.name_map``). Import dispatches on ``config.json``'s ``model_type``; export on the
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
the model is built (on the meta device), so a config that claims 100000 layers is one line at
once, not minutes of building.

Export loads a checkpoint whole in one process and writes ``config.json`` plus safetensors that
``transformers``' ``from_pretrained`` reads, the padding rows dropped and tied copies left out
(as ``save_pretrained`` leaves them out).
"""

from __future__ import annotations

import copy
import os
import re
from typing import Dict, List, Optional

import torch

from megatron_hydra import untrusted
from megatron_hydra.checkpoint import sharded, standalone
from megatron_hydra.config import RunConfig, bundled, derive
from megatron_hydra.config.derive import DTYPES
from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.convert import hf_files, name_map
from megatron_hydra.convert.families import FAMILIES, family_for
from megatron_hydra.convert.mapping import HFWeights
from megatron_hydra.errors import CheckpointError, ConfigError, MegatronHydraError
from megatron_hydra.models.archs import ARCHS
from megatron_hydra.models.backends import logical_parameters
from megatron_hydra.models.init import VOCAB_TABLES
from megatron_hydra.parallel.state import ParallelState

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_BYTES, TOKENIZER_CONFIG_BYTES = 512 * untrusted.MiB, 16 * untrusted.MiB  # far above real ones
CORPUS_PLACEHOLDER = "path/to/corpus_text_document"  # BERT and T5 train on sentence-split data


def _composed(parallel: str, arch: str) -> RunConfig:
    """conf/ composed as ``launch.py`` would for ``parallel=<parallel>`` (and, for BERT and T5,
    the data preset they train on)."""
    known = bundled.group_options("parallel")
    if parallel not in known:
        raise ConfigError(f"parallel={parallel}: no such layout; use one of {', '.join(known)}")
    return bundled.compose([f"parallel={parallel}", *([f"data=indexed_{arch}"] if arch != "gpt" else [])])


def _check_layout(cfg: RunConfig) -> None:
    """The model must split over the layout ``cfg.parallel`` names (derive's checks, with a
    batch any pipeline accepts)."""
    probe = copy.deepcopy(cfg)
    par = probe.parallel
    probe.trainer.devices = par.tensor_parallel_size * par.pipeline_parallel_size
    probe.data.micro_batch_size = 1
    probe.data.global_batch_size = par.pipeline_parallel_size * (par.virtual_pipeline_size or 1) * 2
    derive(probe)


def _default_name(hf_dir: str) -> str:
    base = os.path.basename(os.path.normpath(hf_dir)).lower()
    return re.sub(r"[^a-z0-9_]+", "_", base).strip("_") or "imported"


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def from_hf(input: str, output: str, parallel: str = "single", name: Optional[str] = None) -> str:
    """Import the Hugging Face model directory ``input`` into a checkpoint at ``output``;
    returns the command that fine-tunes it."""
    hf = hf_files.read_config(input)
    kind = hf.value("model_type", str, None)
    if kind not in FAMILIES:
        names = ", ".join(map(str, hf.value("architectures", list, [])))
        raise ConfigError(f"input={input}: model_type={kind!r} ({names}) is not "
                          f"supported: supported are {', '.join(FAMILIES)}")
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ConfigError(f"output={output} already exists and is not empty: choose a new directory")
    name = name or _default_name(input)
    family = FAMILIES[kind]
    composed = _composed(parallel, family.ARCH)
    cfg = RunConfig(model=family.model_config(hf, name), parallel=composed.parallel, run_dir="unused")
    if family.ARCH != "gpt":
        cfg.data = composed.data
    _check_layout(cfg)
    extras = _model_files(input)
    if TOKENIZER in extras:
        cfg.data.tokenizer = TokenizerConfig(type="hf", path=os.path.join(os.path.abspath(output), TOKENIZER))
    cfg, derived = standalone.single_process(cfg)
    cfg.parallel = composed.parallel  # recorded as the intended layout; loading ignores it
    model = _imported_model(family, input, cfg, derived.transformer)
    standalone.save_model(output, model, cfg, derived, layout={"world": 1, "tp": 1, "pp": 1, "dp": 1, "cp": 1, "vpp": 1})
    for file_name, content in extras.items():
        with open(os.path.join(output, file_name), "wb") as f:
            f.write(content)
    return _fine_tune_command(cfg, output, parallel)


def _imported_model(family, input: str, cfg: RunConfig, tcfg) -> torch.nn.Module:
    """The model of ``tcfg`` holding the weights of the directory ``input``. The files' names and
    shapes are checked against the config first, from their headers alone; only then is the model
    built (on the meta device) and given the tensors, so a config.json that claims far more than
    its files hold costs nothing."""
    files = hf_files.read_weights(input)
    weights = HFWeights(files, input, files.shapes)
    name_map.check_files(family.NAME_MAP, weights, tcfg, lambda: _first_layer(cfg))
    model = ARCHS[tcfg.arch].build(tcfg, ParallelState.single(), device="meta")
    ours = name_map.import_weights(family.NAME_MAP, weights, tcfg, sharded.logical_shapes(model, 1, tcfg.vocab_size))
    state = {n: _pad_rows(t, tcfg.padded_vocab_size) if n in VOCAB_TABLES else t for n, t in ours.items()}
    params = _parameters_from_logical(model, state)
    tags = {n: dict(p.__dict__) for n, p in model.named_parameters()}  # TP and expert tags
    model.load_state_dict({n: t.to(tcfg.params_dtype).contiguous() for n, t in params.items()}, strict=True, assign=True)
    for n, p in model.named_parameters():  # assign=True made new Parameters: give them their tags
        p.__dict__.update(tags[n])
    return model


def _first_layer(cfg: RunConfig):
    """The model of ``cfg`` cut to one layer per stack, on the meta device, and its logical
    shapes: what ``name_map.check_files`` compares the files' shapes with before the whole model
    is built."""
    first = copy.deepcopy(cfg)
    first.model.num_layers = min(first.model.num_layers, 1)
    if first.model.num_decoder_layers is not None:
        first.model.num_decoder_layers = min(first.model.num_decoder_layers, 1)
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


def _model_file(directory: str, name: str, limit: int) -> Optional[bytes]:
    """The content of the file ``name`` of the model directory, or None when there is none.

    A model directory comes from anyone, and what is copied from it lands in a checkpoint that may
    be shared: so only a regular file is read, of bounded size, and a link must stay inside the
    directory or, in a Hugging Face cache snapshot, lead to its repository's ``blobs``."""
    path = os.path.join(directory, name)
    if not os.path.lexists(path):
        return None
    target = os.path.realpath(path)
    if not any(_within(target, root) for root in _link_roots(directory)):
        raise CheckpointError(f"{path} is a link to {target}, outside the model directory: refused (copy the "
                              "file itself into the model directory)")
    return untrusted.read_bytes(path, limit, name, CheckpointError)


def _model_files(directory: str) -> Dict[str, bytes]:
    """The model's ``tokenizer.json`` and, beside it, its ``tokenizer_config.json`` (which holds the
    chat template ``data=sft`` renders with), by name: what an import copies."""
    out = {}
    tokenizer = _model_file(directory, TOKENIZER, TOKENIZER_BYTES)
    if tokenizer is not None:
        out[TOKENIZER] = tokenizer
        settings = _model_file(directory, TOKENIZER_CONFIG, TOKENIZER_CONFIG_BYTES)
        if settings is not None:
            out[TOKENIZER_CONFIG] = settings
    return out


def _parameters_from_logical(model: torch.nn.Module, logical: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``model``'s state dict from its logical tensors: a parameter that holds several (an MoE
    layer's stacked experts, ``backends.logical_parameters``) gets them stacked in its order."""
    parts: Dict[str, list] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for lp in logical_parameters(model):
        parts.setdefault(names[id(lp.param)], []).append(lp)
    out = {}
    for name, lps in parts.items():
        if len(lps) == 1 and lps[0].rows is None:
            out[name] = logical[lps[0].name]
        else:
            rest = lps[0].param.shape[1:]
            out[name] = torch.cat([logical[lp.name].reshape(-1, *rest) for lp in lps])
    return out


def _fine_tune_command(cfg: RunConfig, output: str, parallel: str) -> str:
    """``launch.py`` continuing from the import: ``model=from_checkpoint`` reads the model from the
    checkpoint's own config, as data (a checkpoint is never a config search path). BERT and T5
    need their sentence-split corpus (``data.blend``), which the user puts in place of the
    placeholder."""
    par = cfg.parallel
    devices = par.tensor_parallel_size * par.pipeline_parallel_size
    command = (f"python launch.py model=from_checkpoint checkpoint.load={output} checkpoint.load_optimizer=false "
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


def to_hf(input: str, output: str, dtype: Optional[str] = None) -> Dict[str, object]:
    """Export the checkpoint ``input`` as a Hugging Face model directory ``output``."""
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype={dtype}: use float32, bfloat16 or float16 (default: float32)")
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ConfigError(f"output={output} already exists and is not empty: choose a new directory")
    cfg = standalone.read_config(input)
    family = family_for(standalone.single_process(cfg)[1].transformer)
    _, derived, model = standalone.load_model(input, archs=tuple(ARCHS))
    tcfg = derived.transformer
    sd = {lp.name: lp.tensor.detach() for lp in logical_parameters(model)}
    sd = {n: t[: tcfg.vocab_size] if n in VOCAB_TABLES else t for n, t in sd.items()}
    target = DTYPES[dtype or "float32"]
    exported = name_map.export_weights(family.NAME_MAP, sd, tcfg, with_tied=False)
    tensors = {n: t.to(target).contiguous() for n, t in exported.items()}
    config = {**family.hf_config(tcfg), "torch_dtype": dtype or "float32"}
    tokenizer = _tokenizer_source(input, cfg)
    if tokenizer is not None and family.ARCH == "gpt":  # a causal LM starts and ends at end-of-document
        config.update(bos_token_id=tokenizer.eod, eos_token_id=tokenizer.eod)
    files = hf_files.write(output, config, tensors)
    if tokenizer is not None:
        content = untrusted.read_bytes(tokenizer.path, TOKENIZER_BYTES, TOKENIZER, CheckpointError)
        with open(os.path.join(output, TOKENIZER), "wb") as f:
            f.write(content)
        files.append(TOKENIZER)
    return {"architecture": family.MODEL_TYPE, "files": files}
