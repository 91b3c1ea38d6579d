"""Our checkpoint -> a Megatron-Core ``torch_dist`` checkpoint, so a user can go back.

The output is laid out as Megatron-LM saves: ``<output>/iter_NNNNNNN/`` with DCP's files,
``metadata.json`` and ``common.pt`` (``iteration``, ``checkpoint_version``), and
``<output>/latest_checkpointed_iteration.txt``. Tensors carry Megatron-Core 0.16's keys with every
layer stacked into one tensor (``decoder.layers.<name>``, layer first), the norms under their fused
names, SwiGLU's gate and up fused into ``linear_fc1`` as ``[gate; up]``, and the vocabulary tables
with their real rows only: Megatron-Core loads them whatever its own padding
(``allow_shape_mismatch``), the padding rows zero. DCP reshards on load, so Megatron picks its TP
and PP. Each layer is its own chunk, made when the writer reaches it (one tensor in memory), as
Megatron-Core itself writes per-layer chunks; beside them go the local layer spec's
``_extra_state`` entries (empty), which its loader asks for.

The weights alone go back (the run continues with ``--no-load-optim --no-load-rng``); Megatron-LM's
arguments are not written, since Megatron-LM compares its own against them: the printed flags
describe the model to it instead (its shape, sequence length and tokenizer). The activation
follows Megatron-Core's rule (``megatron_args``): the tanh GeLU is its fused bias-GeLU, on by
default with biases, and the exact one needs ``--no-bias-gelu-fusion``; a tanh GeLU without
biases has no flag. A model feature Megatron-Core lacks is one line.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megatron_hydra.checkpoint import plan, sharded, standalone, store
from megatron_hydra.checkpoint.safe_reader import dcp_failure
from megatron_hydra.checkpoint.standalone import one_process
from megatron_hydra.config.schema import DataConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import staging
from megatron_hydra.convert.api import check_output
from megatron_hydra.convert.megatron_names import DECODER_LAYERS, Part, parts
from megatron_hydra.data import bpe_files
from megatron_hydra.errors import ConfigError, DataError

EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}


@dataclass(frozen=True)
class LazyChunks:
    """A tensor of ``shape`` written as ``pieces`` (offsets, sizes, a function making that piece),
    each made when the writer reaches it."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    pieces: Tuple[Tuple[Tuple[int, ...], Tuple[int, ...], Callable[[], torch.Tensor]], ...]

    def __create_write_items__(self, fqn: str, obj) -> List[WriteItem]:
        properties = TensorProperties.create_from_tensor(torch.empty(0, dtype=self.dtype))
        out = []
        for offsets, sizes, _ in self.pieces:
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            out.append(WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                                 tensor_data=TensorWriteData(chunk=chunk, properties=properties,
                                                             size=torch.Size(self.shape))))
        return out

    def make(self, offsets: Tuple[int, ...]) -> torch.Tensor:
        for at, sizes, make in self.pieces:
            if tuple(at) == tuple(offsets):
                return make().to(self.dtype).reshape(sizes).contiguous()
        raise ValueError(f"no piece at {list(offsets)}")


class _Planner(dcp.DefaultSavePlanner):
    """DCP's planner, making ``LazyChunks``' pieces when their turn comes and writing byte entries
    as they are (DCP would pickle the buffer object itself; Megatron reads the bytes it holds)."""

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.make(tuple(index.offset)) if isinstance(obj, LazyChunks) else super().lookup_object(index)

    def transform_object(self, write_item: WriteItem, object):
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


@dataclass
class Exported:
    directory: str
    iteration: int
    flags: List[str]
    notes: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"exported -> {self.directory} (torch_dist, iteration {self.iteration})",
                 *(f"note: {n}" for n in self.notes), "load it in Megatron-LM with:"]
        return "\n".join([*lines, f"  {' '.join(self.flags)}"])


def why_not(cfg: TransformerConfig) -> str:
    """What in ``cfg`` Megatron-Core's GPT model does not compute, or ''."""
    s = cfg.rope_scaling
    checks = [
        (cfg.moe is not None, "model.moe"),
        (cfg.lora is not None, "LoRA adapters (merge them first)"),
        (cfg.position_embedding not in ("learned", "rope"), f"model.position_embedding={cfg.position_embedding}"),
        (cfg.activation not in ("gelu", "gelu_tanh", "swiglu"), f"model.activation={cfg.activation}"),
        (cfg.sliding_window is not None, "model.sliding_window"),
        (cfg.attn_logit_softcapping is not None or cfg.final_logit_softcapping is not None, "logit soft-capping"),
        (cfg.post_sublayer_norm, "model.post_sublayer_norm"),
        (cfg.scale_embeddings, "model.scale_embeddings"),
        (cfg.softmax_scale is not None, "model.query_pre_attn_scalar"),
        (cfg.local_rope_theta is not None, "model.local_rope_theta"),
        (cfg.activation == "gelu_tanh" and not cfg.add_bias_linear,
         "model.activation=gelu_tanh without biases (Megatron-Core's tanh GeLU is its fused bias-GeLU)"),
        (cfg.add_bias_linear and not cfg.qkv_bias, "model.qkv_bias=false with model.add_bias_linear=true (Megatron's "
                                                    "linear_qkv has a bias whenever the other layers do)"),
        (cfg.position_embedding == "rope" and not float(cfg.rope_theta).is_integer(),
         f"model.rope_theta={cfg.rope_theta} (Megatron-LM's --rotary-base is an integer)"),
        (s is not None and not (s.type == "linear" and float(s.factor).is_integer()) and not (
            s.type == "llama3" and (s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor)
            == (8192, 1.0, 4.0)), "model.rope_scaling (Megatron has llama3 with its fixed constants, integer linear)"),
    ]
    return next((what for bad, what in checks if bad), "")


def tokenizer_flags(data: DataConfig, vocab_size: int) -> Tuple[List[str], List[str]]:
    """Megatron-LM's tokenizer flags for the run's ``data.tokenizer`` (a model of ``vocab_size``
    tokens), and a note where it has no counterpart there: then the NullTokenizer of the same
    size stands in (enough to load the model and train on data already tokenized)."""
    tok = data.tokenizer
    if data.name != "synthetic" and tok.path:
        if tok.type == "hf":
            folder = os.path.dirname(tok.path) if tok.path.endswith(".json") else tok.path  # its tokenizer.json's
            return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder], []
        if tok.type == "sentencepiece":
            return ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", tok.path], []
        if tok.type == "tiktoken":
            return ["--tokenizer-type", "Llama3Tokenizer", "--tokenizer-model", tok.path], []
        if tok.type == "gpt2_bpe":
            try:
                vocab, merges = bpe_files.gpt2_files(os.path.expanduser(tok.path), tok.merge_file)
                return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges], []
            except DataError as e:  # its vocab and merges files are not where the config says
                return _null_tokenizer(vocab_size, f"data.tokenizer.path={tok.path}: {e}")
    if data.name == "synthetic":
        return _null_tokenizer(vocab_size, None)
    return _null_tokenizer(vocab_size, f"data.tokenizer.type={tok.type} has no Megatron-LM counterpart here")


def _null_tokenizer(vocab_size: int, why: Optional[str]) -> Tuple[List[str], List[str]]:
    """Megatron-LM's NullTokenizer of the model's vocabulary (its size plus the end-of-document id),
    and the note saying why it stands in (``why``; None: nothing to say, synthetic data)."""
    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", vocab_size - 1]
    if why is None:
        return flags, []
    return flags, [f"{why}: the flags name a NullTokenizer of the model's {vocab_size} tokens; give Megatron-LM the "
                   "tokenizer the data was made with"]


def flags(cfg: TransformerConfig, load: str, tokenizer: Tuple[str, ...] = ()) -> List[str]:
    """Megatron-LM's flags for the model ``cfg`` describes, loading the export at ``load``, with
    the ``tokenizer`` flags (``tokenizer_flags``)."""
    out = ["--num-layers", cfg.num_layers, "--hidden-size", cfg.hidden_size, "--ffn-hidden-size", cfg.ffn_hidden_size,
           "--num-attention-heads", cfg.num_attention_heads, "--kv-channels", cfg.kv_channels,
           "--seq-length", cfg.seq_length, "--max-position-embeddings", cfg.max_position_embeddings,
           "--normalization", "RMSNorm" if cfg.normalization == "rmsnorm" else "LayerNorm", "--norm-epsilon",
           cfg.norm_eps, *tokenizer]
    if cfg.num_query_groups != cfg.num_attention_heads:
        out += ["--group-query-attention", "--num-query-groups", cfg.num_query_groups]
    if cfg.position_embedding == "rope":
        out += ["--position-embedding-type", "rope", "--rotary-base", int(cfg.rope_theta)]
        if cfg.rope_scaling is not None and cfg.rope_scaling.type == "llama3":
            out += ["--use-rope-scaling", "--rope-scaling-factor", cfg.rope_scaling.factor]
        elif cfg.rope_scaling is not None:
            out += ["--rotary-seq-len-interpolation-factor", int(cfg.rope_scaling.factor)]
    # gelu_tanh: Megatron's default fused bias-GeLU (why_not refuses it without biases)
    out += {"swiglu": ["--swiglu"], "gelu_tanh": [], "gelu": ["--no-bias-gelu-fusion"]}[cfg.activation]
    out += [] if cfg.add_bias_linear else ["--disable-bias-linear"] + (["--add-qkv-bias"] if cfg.qkv_bias else [])
    out += [] if cfg.tie_embeddings else ["--untie-embeddings-and-output-weights"]
    out += ["--qk-layernorm"] if cfg.qk_norm else []
    out += ["--apply-layernorm-1p"] if cfg.zero_centered_gamma else []
    out += ["--transformer-impl", "local", "--ckpt-format", "torch_dist", "--load", load, "--no-load-optim",
            "--no-load-rng"]
    return [str(x) for x in out]


def _reader(path: str, sources) -> Callable[[str], torch.Tensor]:
    def read(name: str) -> torch.Tensor:
        return next(iter(standalone.read_tensors(path, [sources[name]])))[1]
    return read


def _stacked(places: Dict[str, Part], shapes, dtypes, read, layers: int) -> Dict[str, LazyChunks]:
    """Megatron's stored tensors, each of our logical tensors one piece of one of them."""
    grouped: Dict[str, list] = {}
    for name, part in places.items():
        grouped.setdefault(part.key if part.layer is None else DECODER_LAYERS + part.key, []).append(name)
    out = {}
    for key, names in grouped.items():
        first = places[names[0]]
        inner = list(shapes[names[0]])
        if first.half is not None:
            inner[0] *= 2
        shape = tuple(inner) if first.layer is None else (layers, *inner)
        pieces = []
        for name in names:
            part, own = places[name], tuple(shapes[name])
            at = [0] * len(inner)
            if part.half is not None:
                at[0] = part.half * own[0]
            if part.layer is not None:
                at, own = [part.layer, *at], (1, *own)
            pieces.append((tuple(at), own, lambda name=name: read(name)))
        out[key] = LazyChunks(shape, dtypes[names[0]], tuple(pieces))
    return out


def _extra_states(layers: int) -> Dict[str, io.BytesIO]:
    """The local layer spec's ``_extra_state`` entries (each ``[None]``, as Megatron-Core saves them)."""
    out = {}
    for module in EXTRA_STATE_MODULES:
        for i in range(layers):
            data = io.BytesIO()
            torch.save([None], data)
            data.seek(0)
            out[f"{DECODER_LAYERS}{module}._extra_state/shard_{i}_{layers}"] = data
    return out


def to_megatron(input: str, output: str) -> Exported:
    """Export our GPT checkpoint ``input`` as Megatron-LM's ``torch_dist`` checkpoint directory ``output``."""
    check_output(output)
    cfg, derived = standalone.checked_config(input)
    tcfg = derived.transformer
    problem = why_not(tcfg)
    if problem:
        raise ConfigError(f"input={input}: {problem} has no Megatron-Core counterpart: this model cannot be exported "
                          "to Megatron")
    sharded.verify(input, torch.device("cpu"))
    shapes = plan.logical_shapes(derived)
    sources = standalone.tensor_sources(input, shapes)
    places = parts(list(shapes), tcfg.activation == "swiglu")
    step = store.read_meta(input)["step"]
    state = {**_stacked(places, shapes, {n: s[2] for n, s in sources.items()}, _reader(input, sources),
                        tcfg.num_layers), **_extra_states(tcfg.num_layers)}
    name = f"iter_{step:07d}"
    with staging.staged(output) as stage:
        directory = os.path.join(stage, name)
        os.mkdir(directory)
        try:
            with one_process():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, thread_count=1), planner=_Planner(),
                         no_dist=True)
        except CheckpointException as e:
            raise dcp_failure(e) from None
        torch.save({"checkpoint_version": 3.0, "iteration": step}, os.path.join(directory, "common.pt"))
        with open(os.path.join(directory, "metadata.json"), "w") as f:
            json.dump(METADATA, f)
        with open(os.path.join(stage, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(f"{step}\n")
    tokenizer, notes = tokenizer_flags(cfg.data, tcfg.vocab_size)
    return Exported(output, step, flags(tcfg, output, tuple(tokenizer)), notes)
