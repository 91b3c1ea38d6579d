"""A whole model in one process, to and from a checkpoint: what conversion and generation need.

Training checkpoints are layout-free (``sharded``), so one process without any process group can
read all of a checkpoint that tp x pp ranks wrote, or write one that any layout then loads. The
checkpoint's own resolved config (``meta.json``) says what model it holds; here it is re-derived
for a single process (tp = pp = dp = 1), keeping every model shape, so the logical tensors match.

That config is data from elsewhere: it may describe a model of terabytes. So nothing is allocated
before the checkpoint is shown to hold that model (``check_before_building``): its layer count,
its tensors' names and shapes on the meta device, and the bytes its tensor files hold.
"""

from __future__ import annotations

import copy
import math
import os
import stat
import warnings
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch

from megatron_hydra.checkpoint import plan, sharded, store
from megatron_hydra.checkpoint.safe_reader import read_metadata
from megatron_hydra.config import Derived, RunConfig, derive
from megatron_hydra.config.io import from_yaml
from megatron_hydra.config.schema import ParallelConfig
from megatron_hydra.errors import CheckpointError
from megatron_hydra.models.archs import ARCHS
from megatron_hydra.parallel.state import ParallelState


@contextmanager
def _one_process():
    """DCP warns that it assumes a single process when there is no process group: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
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


@torch.no_grad()
def load_model(path: str, seq_length: Optional[int] = None,
               archs: Tuple[str, ...] = ("gpt",)) -> Tuple[RunConfig, Derived, torch.nn.Module]:
    """The model saved at ``path``, whole, in this process, in eval mode; its ``model.arch`` must
    be one of ``archs`` (the families the caller handles: generation takes GPT only)."""
    cfg = read_config(path)
    if cfg.model.arch not in archs:
        raise CheckpointError(f"{path} holds a model.arch={cfg.model.arch} model: only "
                              f"{' and '.join(a.upper() for a in archs)} checkpoints load whole here")
    cfg, derived = single_process(cfg, seq_length)
    check_before_building(path, derived)
    ps = ParallelState.single()
    model = ARCHS[cfg.model.arch].build(derived.transformer, ps)
    with _one_process():
        sharded.load(path, model, None, ps, derived.transformer.vocab_size, load_optimizer=False)
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


def check_before_building(path: str, derived: Derived) -> None:
    """That the checkpoint at ``path`` holds the model ``derived`` describes, before a byte of it
    is allocated (one line otherwise): the layers the config asks for are in meta.json's shapes
    (building even on the meta device takes time per layer), the model built on the meta device
    has those names and shapes, and the tensor files DCP reads hold at least their bytes."""
    tcfg = derived.transformer
    wanted = tcfg.num_layers + ((getattr(tcfg, "num_decoder_layers", 0) or 0) if tcfg.arch == "t5" else 0)
    recorded: Dict[str, List[int]] = store.read_meta(path)["shapes"]
    if wanted > _stacked_layers(recorded):
        raise CheckpointError(f"{path}: its config describes {wanted} layers but its tensors hold "
                              f"{_stacked_layers(recorded)}: the checkpoint is damaged or crafted; refused")
    expected = plan.logical_shapes(derived)
    sharded.check_shapes(path, recorded, expected, True, False)
    needed = sum(math.prod(shape) for shape in expected.values()) * tcfg.params_dtype.itemsize
    held = _tensor_file_bytes(path, read_metadata(path))
    if held < needed:
        raise CheckpointError(f"{path}: its model tensors take {needed:,} bytes but its tensor files hold only "
                              f"{held:,}: the checkpoint is damaged or crafted; refused")


def save_model(path: str, model: torch.nn.Module, cfg: RunConfig, derived: Derived, layout: dict, step: int = 0,
               consumed_samples: int = 0) -> None:
    """Write ``model`` (whole, this process) as a weights-only checkpoint at ``path``, without
    random states: this process's are no run's, so a run loading it starts from its own seeds."""
    meta = plan.meta(cfg, derived, step, consumed_samples, saved_layout=layout)
    with _one_process():
        sharded.save(path, model, None, ParallelState.single(), derived.transformer.vocab_size, meta,
                     rng_states=False)


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
