"""A whole model in one process, to and from a checkpoint: what conversion and generation need.

Training checkpoints are layout-free (``sharded``), so one process without any process group can
read all of a checkpoint that tp x pp ranks wrote, or write one that any layout then loads. The
checkpoint's own resolved config (``meta.json``) says what model it holds; here it is re-derived
for a single process (tp = pp = dp = 1), keeping every model shape, so the logical tensors match.

That config is data from elsewhere: it may describe a model of terabytes. So nothing is allocated
before the checkpoint is shown to hold that model (``check_before_building``): its layer count,
its tensors' names and shapes on the meta device, and the bytes its tensor files hold.

A LoRA model is a base checkpoint plus an adapter checkpoint (``checkpoint.adapters``): the
adapters' own config gives their rank, targets and scale, so a caller names the two paths only.

A conversion needs the tensors but never the model: ``save_tensors`` writes logical tensors made
one at a time (``lazy_write``), and ``read_tensors`` reads them back a few at a time, so neither
holds more than a small part of the model.
"""

from __future__ import annotations

import copy
import math
import os
import stat
import warnings
from contextlib import contextmanager
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_hydra.checkpoint import adapters, lazy_write, plan, sharded, store
from megatron_hydra.checkpoint.lazy_write import LazyTensor
from megatron_hydra.checkpoint.safe_reader import read_metadata, safe_load
from megatron_hydra.checkpoint.selection import check_shapes, select_names
from megatron_hydra.config import Derived, RunConfig, derive
from megatron_hydra.config.io import from_yaml
from megatron_hydra.config.schema import ParallelConfig
from megatron_hydra.errors import CheckpointError
from megatron_hydra.models.archs import ARCHS
from megatron_hydra.parallel.state import ParallelState


@contextmanager
def one_process():
    """DCP warns that it assumes a single process when there is no process group: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is (disabled|not initialized).*")
        yield


def read_config(path: str) -> RunConfig:
    """The run config stored in the checkpoint at ``path`` (validated as a complete checkpoint)."""
    meta = store.validate(path)
    if "config" not in meta:
        raise CheckpointError(f"{path}/{store.META} holds no config: it was not written by megatron-hydra")
    return from_yaml(meta["config"], f"{path}/{store.META}")


def single_process(cfg: RunConfig, seq_length: Optional[int] = None) -> Tuple[RunConfig, Derived]:
    """``cfg`` for one process (no TP, PP, DP; the same model shapes), optionally with another
    ``seq_length`` (rotary tables; learned position tables keep their size)."""
    cfg = copy.deepcopy(cfg)
    max_pos = cfg.model.max_position_embeddings or cfg.model.seq_length
    cfg.parallel = ParallelConfig()
    cfg.trainer.devices, cfg.trainer.num_nodes = 1, 1
    cfg.model.max_position_embeddings = max_pos
    # The local layers, on any machine: a checkpoint is the same whichever implementation wrote it.
    cfg.model.transformer_impl, cfg.precision.fp8 = "local", None
    if seq_length is not None:
        cfg.model.seq_length = seq_length
    return cfg, derive(cfg)


def checked_config(path: str, seq_length: Optional[int] = None, archs: Tuple[str, ...] = ("gpt",),
                   adapter: Optional[str] = None) -> Tuple[RunConfig, Derived]:
    """The config of the checkpoint at ``path`` for one process, once the checkpoint is shown to
    hold that model (``check_before_building``); its ``model.arch`` must be one of ``archs`` (the
    families the caller handles: generation takes GPT only). With ``adapter`` (an adapter
    checkpoint trained on that model) the config has its peft settings and both are checked."""
    adapters.refuse_adapter_only(path, "checkpoint.load", store.validate(path))
    cfg = read_config(path)
    if cfg.model.arch not in archs:
        raise CheckpointError(f"{path} holds a model.arch={cfg.model.arch} model: only "
                              f"{' and '.join(a.upper() for a in archs)} checkpoints load whole here")
    if adapter is not None:
        cfg = adapters.adopt(cfg, adapter)
    cfg, derived = single_process(cfg, seq_length)
    check_before_building(path, derived, select="base" if adapter is not None else None)
    if adapter is not None:
        check_before_building(cfg.peft.adapter, derived, select="adapters", key="peft.adapter")
    return cfg, derived


@torch.no_grad()
def load_model(path: str, seq_length: Optional[int] = None, archs: Tuple[str, ...] = ("gpt",),
               adapter: Optional[str] = None) -> Tuple[RunConfig, Derived, torch.nn.Module]:
    """The model saved at ``path``, whole, in this process, in eval mode; its ``model.arch`` must
    be one of ``archs``. ``adapter``: LoRA adapters trained on it, loaded beside it (not merged)."""
    cfg, derived = checked_config(path, seq_length, archs, adapter)
    ps = ParallelState.single()
    model = ARCHS[cfg.model.arch].build(derived.transformer, ps)
    with one_process():
        sharded.load(path, model, None, ps, derived.transformer.vocab_size, load_optimizer=False,
                     select="base" if adapter is not None else None)
        if adapter is not None:
            sharded.load(cfg.peft.adapter, model, None, ps, derived.transformer.vocab_size, load_optimizer=False,
                         select="adapters", key="peft.adapter")
    return cfg, derived, model.eval()


def _stacked_layers(names) -> int:
    """Blocks among logical tensor names: ``layers.3.*`` (GPT, BERT), ``encoder.3.*`` (T5), ..."""
    return len({tuple(n.split(".")[:2]) for n in names if n.count(".") >= 2 and n.split(".")[1].isdigit()})


def _tensor_file_bytes(path: str, metadata) -> int:
    """The bytes of the distinct regular files DCP's metadata says the tensors are in."""
    total = 0
    for name in {str(info.relative_path) for info in (metadata.storage_data or {}).values()}:
        try:
            st = os.lstat(os.path.join(path, name))
        except OSError:
            continue  # missing: the checksum check names it
        total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def stored_entry(path: str, metadata, key: str) -> Optional[Tuple[List[int], torch.dtype]]:
    """The shape and dtype DCP's metadata records for ``key`` (``None`` when it has no such entry),
    checked to be a shape and a dtype: the file is anyone's."""
    md = metadata.state_dict_metadata.get(key)
    if md is None:
        return None
    size, dtype = getattr(md, "size", None), getattr(getattr(md, "properties", None), "dtype", None)
    if not isinstance(size, torch.Size) or not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{path}/{store.DCP_METADATA}: the entry of {key} is malformed: the checkpoint is "
                              "damaged or crafted; refused")
    return list(size), dtype


def check_before_building(path: str, derived: Derived, select: Optional[str] = None,
                          key: Optional[str] = None) -> None:
    """That the checkpoint at ``path`` holds the model ``derived`` describes (the part ``select``
    names; ``key``: the setting that gave ``path``), before a byte of it is allocated (one line
    otherwise): the layers the config asks for are in meta.json's shapes (building even on the
    meta device takes time per layer), the model built on the meta device has those names and
    shapes, and the tensor files DCP reads hold at least their bytes."""
    tcfg = derived.transformer
    wanted = tcfg.num_layers + ((getattr(tcfg, "num_decoder_layers", 0) or 0) if tcfg.arch == "t5" else 0)
    recorded: Dict[str, List[int]] = select_names(store.read_meta(path, key=key or "checkpoint.load")["shapes"],
                                                  select)
    if select != "adapters" and wanted > _stacked_layers(recorded):  # adapters: the base was checked
        raise CheckpointError(f"{path}: its config describes {wanted} layers but its tensors hold "
                              f"{_stacked_layers(recorded)}: the checkpoint is damaged or crafted; refused")
    expected = plan.logical_shapes(derived, select)
    check_shapes(path, recorded, expected, True, False, select=select, key=key)
    metadata = read_metadata(path)
    # Each tensor in the dtype it was saved in (an import keeps its source's), which loading casts.
    needed = sum(math.prod(shape)
                 * (stored_entry(path, metadata, f"model/{name}") or ([], tcfg.params_dtype))[1].itemsize
                 for name, shape in expected.items())
    held = _tensor_file_bytes(path, metadata)
    if held < needed:
        raise CheckpointError(f"{path}: its model tensors take {needed:,} bytes but its tensor files hold only "
                              f"{held:,}: the checkpoint is damaged or crafted; refused")


def save_model(path: str, model: torch.nn.Module, cfg: RunConfig, derived: Derived, layout: dict, step: int = 0,
               consumed_samples: int = 0) -> None:
    """Write ``model`` (whole, this process) as a weights-only checkpoint at ``path``, without
    random states: this process's are no run's, so a run loading it starts from its own seeds."""
    meta = plan.meta(cfg, derived, step, consumed_samples, saved_layout=layout)
    with one_process():
        sharded.save(path, model, None, ParallelState.single(), derived.transformer.vocab_size, meta,
                     rng_states=False)


def save_tensors(path: str, tensors: Mapping[str, LazyTensor], cfg: RunConfig, derived: Derived,
                 files: Optional[Mapping[str, bytes]] = None, optimizer: Optional[Mapping[str, LazyTensor]] = None,
                 step: int = 0, consumed_samples: int = 0, select: Optional[str] = None) -> None:
    """Write the logical tensors of the model ``derived`` describes, one at a time, as a
    checkpoint into the empty directory ``path`` (``lazy_write``), each in the dtype it is made
    in; ``files`` (name -> content) go beside them, under the checksums. The tensors must be
    exactly the model's (the caller has checked them against their source). Without
    ``optimizer`` (entries under their checkpoint keys, ``lazy_write.write``) it is weights-only at
    step 0; with it, a run loading it resumes at ``step`` with ``consumed_samples``. ``select``:
    the part of the model the tensors are (``checkpoint.selection``; "adapters": an adapter
    checkpoint). The layout recorded is ``derived``'s, one process for a conversion's."""
    meta = plan.meta(cfg, derived, step, consumed_samples, select=select)
    expected = meta["shapes"]
    given = {n: list(t.shape) for n, t in tensors.items()}
    if given != expected:
        wrong = sorted(n for n in set(given) | set(expected) if given.get(n) != expected.get(n))
        raise ValueError(f"{wrong[0]}: {given.get(wrong[0])} given, {expected.get(wrong[0])} in the model")
    for name, content in (files or {}).items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(content)
    dtypes = {str(t.dtype) for t in tensors.values()}
    # What the tensors are stored in (the run's params_dtype is whatever loads them): a file may mix
    # dtypes (fp32 norms beside bf16 matrices), which DCP's metadata records per tensor.
    meta["dtype"] = dtypes.pop() if len(dtypes) == 1 else "mixed"
    with one_process():
        lazy_write.write(path, tensors, meta, optimizer)


def tensor_sources(path: str, shapes: Mapping[str, Sequence[int]],
                   main: bool = False) -> Dict[str, Tuple[str, List[int], torch.dtype]]:
    """Where each logical tensor of ``shapes`` is in the checkpoint at ``path`` (key, shape, and the
    dtype it was saved in): ``model/<name>``, or with ``main`` the fp32 main weights that a 16-bit
    run keeps beside its model (``main/<name>``) where there are some. A tensor that DCP's metadata
    lacks, or holds in another shape, is one line: the checkpoint is damaged or crafted."""
    metadata = read_metadata(path)
    out = {}
    for name, shape in shapes.items():
        key = f"main/{name}" if main and f"main/{name}" in metadata.state_dict_metadata else f"model/{name}"
        found = stored_entry(path, metadata, key)
        if found is None or found[0] != list(shape):
            raise CheckpointError(f"{path}: tensor {key} is {found[0] if found else 'missing'} in its "
                                  f"{store.DCP_METADATA} but {list(shape)} in {store.META}: the checkpoint is damaged "
                                  "or crafted; refused")
        out[name] = key, found[0], found[1]
    return out


# Bytes of logical tensors one read brings in: far below a model, far above DCP's cost per read.
READ_BYTES = 256 * 1024**2


def read_tensors(path: str, tensors: Sequence[Tuple[str, List[int], torch.dtype]],
                 read_bytes: Optional[int] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """The whole tensors of the checkpoint at ``path`` that ``tensors`` names (``tensor_sources``:
    key, shape, stored dtype), in this order and each in its stored dtype, a few at a time: each
    read brings in consecutive tensors up to ``read_bytes`` (default ``READ_BYTES``; at least
    one), whatever layout wrote them, so memory holds one read, never the model. Check the
    checkpoint first (``checked_config``, ``sharded.verify``)."""
    read_bytes = READ_BYTES if read_bytes is None else read_bytes
    group: list = []
    size = 0
    for item in [*tensors, None]:
        nbytes = 0 if item is None else math.prod(item[1]) * item[2].itemsize
        if group and (item is None or size + nbytes > read_bytes):
            sd = {key: torch.empty(shape, dtype=dtype) for key, shape, dtype in group}
            with one_process():
                safe_load(sd, path)
            for key, _, _ in group:
                yield key, sd.pop(key)
            group, size = [], 0
        if item is not None:
            group.append(item)
            size += nbytes


def tokenizer_for(path: str, cfg: RunConfig):
    """The tokenizer of the checkpoint at ``path``: its own ``tokenizer.json`` (an import), else
    the one its training data was tokenized with; ``None`` for synthetic data (no text)."""
    from megatron_hydra.data.tokenizers import HFTokenizer

    own = os.path.join(path, "tokenizer.json")
    if os.path.isfile(own):
        return HFTokenizer(own)
    if cfg.data.name == "synthetic":
        return None
    from megatron_hydra.data.builders import build_tokenizer_for

    return build_tokenizer_for(cfg.data)
