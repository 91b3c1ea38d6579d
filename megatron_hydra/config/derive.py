"""Derive every computed value of a run and validate the config, before any worker starts.

Pure functions of the composed ``RunConfig``: no torch.distributed, no devices. Everything that
depends on more than one key (dp size, micro-batch count, padded vocab, layers per stage) is
computed here once and handed down in ``Derived``; nobody recomputes it elsewhere. Each violation
raises ``ConfigError`` with one line that names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron_hydra.config import architecture
from megatron_hydra.config.compile import check_compile
from megatron_hydra.config.inference import check_inference
from megatron_hydra.config.moe import moe_spec
from megatron_hydra.config.observability import check_observability
from megatron_hydra.config.optim import check_optim
from megatron_hydra.config.peft import check_objective, check_peft, lora_spec
from megatron_hydra.config.ranges import check_ranges
from megatron_hydra.config.schema import PACKED_DOCUMENT_DATA, FP8Config, ModelConfig, RunConfig
from megatron_hydra.config.transformer_config import FP8Recipe, TransformerConfig, by_name
from megatron_hydra.errors import ConfigError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Keys a preset may leave as ``auto``: ``config.machine.resolve`` picks them for the machine before
# derive runs; derive itself never looks at the machine.
AUTO_KEYS = ("trainer.accelerator", "trainer.devices", "precision.params_dtype", "data.num_workers")


@dataclass(frozen=True)
class Derived:
    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int
    num_microbatches: int
    layers_per_stage: Tuple[int, ...]  # one entry per virtual stage, in model order
    transformer: TransformerConfig
    # Samples the train/valid/test splits must provide: every step's global batch, and the first
    # limit_val_batches global batches of the valid split (the same ones at each validation, so
    # validation losses are comparable along the run).
    split_samples: Tuple[int, int, int] = (0, 0, 0)
    # data.global_batch_size, or its default when null (``global_batch_size``).
    global_batch_size: int = 0
    ep: int = 1  # expert-parallel degree, a factor of dp (parallel.expert_parallel_size)
    etp: Optional[int] = None  # the experts' TP degree when it is not tp: 1 (parallel.expert_tensor_parallel_size)


def _get(cfg: RunConfig, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_resolved(cfg: RunConfig) -> None:
    """``auto`` must be resolved first; any other text in an int-or-auto key is a typo."""
    for key in AUTO_KEYS:
        if _get(cfg, key) == "auto":
            raise ConfigError(f"{key}=auto is chosen for the machine by megatron_hydra.config.machine.resolve, which "
                              f"launch.py runs before derive: resolve the config first, or give {key} a value")
    for key, what in (("trainer.devices", "a positive integer"), ("data.num_workers", "an integer >= 0")):
        if isinstance(_get(cfg, key), str):
            raise ConfigError(f"{key}={_get(cfg, key)!r} must be {what} or auto")


@functools.lru_cache(maxsize=None)
def _schema_fields(cls: type) -> Tuple[Tuple[str, Optional[tuple], Optional[type]], ...]:
    """(name, the choices ``schema.one_of`` lists or None, the nested schema class or None) of
    each field of ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        nested = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)]
        out.append((f.name, f.metadata.get("choices"), nested[0] if nested else None))
    return tuple(out)


def _check_choices(node, cls: type = RunConfig, prefix: str = "") -> None:
    """Every key that lists its choices in the schema holds one of them; a nested config left
    null (precision.fp8, model.moe, cluster) has nothing to check."""
    for name, allowed, nested in _schema_fields(cls):
        value, key = getattr(node, name), prefix + name
        if allowed is not None and value not in allowed:
            shown = ", ".join("null" if a is None else a for a in allowed)
            raise ConfigError(f"{key}={value!r} is not supported: use one of {shown}")
        if nested is not None and value is not None:
            _check_choices(value, nested, key + ".")


def _check_positive(cfg: RunConfig) -> None:
    keys = (
        "trainer.devices", "trainer.num_nodes", "trainer.max_steps", "trainer.log_every_n_steps",
        "parallel.tensor_parallel_size", "parallel.pipeline_parallel_size", "parallel.context_parallel_size",
        "model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.seq_length",
        "model.vocab_size", "model.make_vocab_size_divisible_by",
        "data.micro_batch_size", "parallel.grad_bucket_size",
        "trainer.collective_timeout_s", "trainer.limit_val_batches",
    )
    for key in keys:
        value = _get(cfg, key)
        if value < 1:
            raise ConfigError(f"{key}={value} must be a positive integer")
    for key in ("data.global_batch_size", "model.num_query_groups", "model.ffn_hidden_size", "model.kv_channels",
                "parallel.virtual_pipeline_size", "trainer.num_threads", "optim.decay_steps"):
        value = _get(cfg, key)
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be a positive integer or null (derived)")
    for key in ("checkpoint.every_n_steps", "checkpoint.keep_last", "trainer.val_check_interval", "data.num_workers",
                "trainer.generate_sample_tokens"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= 0 (0 disables it)")
    for key in ("model.hidden_dropout", "model.attention_dropout"):
        value = _get(cfg, key)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key}={value} must be in [0, 1)")
    if cfg.optim.lr <= 0 or cfg.optim.min_lr < 0 or cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.lr={cfg.optim.lr} and optim.min_lr={cfg.optim.min_lr} need 0 <= min_lr <= lr and lr > 0")
    if cfg.trainer.peak_tflops is not None and not cfg.trainer.peak_tflops > 0:
        raise ConfigError(f"trainer.peak_tflops={cfg.trainer.peak_tflops} must be positive (TFLOP/s per rank), or "
                          "null for the GPU's datasheet peak or a CPU matmul measured at start-up")
    if cfg.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps} must be >= 0")
    if cfg.optim.clip_grad < 0:
        raise ConfigError(f"optim.clip_grad={cfg.optim.clip_grad} must be >= 0 (0 disables clipping)")
    pr = cfg.precision
    if not 0 < pr.min_loss_scale <= pr.initial_loss_scale:
        raise ConfigError(f"precision.min_loss_scale={pr.min_loss_scale} and precision.initial_loss_scale="
                          f"{pr.initial_loss_scale} need 0 < min_loss_scale <= initial_loss_scale")
    for key in ("precision.loss_scale_window", "precision.hysteresis"):
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be a positive integer")


def _parallel_degrees(cfg: RunConfig) -> Tuple[int, int, int, int, int]:
    par = cfg.parallel
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    tp, pp, cp = par.tensor_parallel_size, par.pipeline_parallel_size, par.context_parallel_size
    model_parallel = tp * pp * cp
    if world % model_parallel:
        raise ConfigError(
            f"trainer.devices x trainer.num_nodes = {world} ranks is not divisible by tensor x pipeline x context "
            f"parallel = {tp}x{pp}x{cp} = {model_parallel}: use a multiple of {model_parallel} ranks or smaller parallel sizes"
        )
    return world, tp, pp, cp, world // model_parallel


def size_defaults(hidden_size: int, num_attention_heads: int, activation: str, seq_length: int) -> Dict[str, int]:
    """The sizes a model's null keys take (``ffn_hidden_size``, ``kv_channels``,
    ``num_query_groups``, ``max_position_embeddings``): the one rule for derive and for whoever
    compares a model with null keys to one with sizes written out (migrate)."""
    if activation == "swiglu":  # SwiGLU's three matrices at 8/3 h hold as many weights as two at 4 h
        ffn = 256 * math.ceil(int(8 * hidden_size / 3) / 256)
    else:
        ffn = 4 * hidden_size
    return {"ffn_hidden_size": ffn, "kv_channels": hidden_size // num_attention_heads if num_attention_heads else 0,
            "num_query_groups": num_attention_heads, "max_position_embeddings": seq_length}


def _defaults(m: ModelConfig) -> Dict[str, int]:
    return size_defaults(m.hidden_size, m.num_attention_heads, m.activation, m.seq_length)


def _attention_shape(cfg: RunConfig, tp: int) -> Tuple[int, int]:
    m = cfg.model
    heads = m.num_attention_heads
    groups = _defaults(m)["num_query_groups"] if m.num_query_groups is None else m.num_query_groups
    if heads % tp:
        raise ConfigError(
            f"model.num_attention_heads={heads} is not divisible by parallel.tensor_parallel_size={tp}: "
            f"use a tensor_parallel_size in {_divisors(heads)}"
        )
    if heads % groups:
        raise ConfigError(
            f"model.num_attention_heads={heads} is not divisible by model.num_query_groups={groups}: "
            f"use num_query_groups in {_divisors(heads)}"
        )
    if groups % tp:
        raise ConfigError(
            f"model.num_query_groups={groups} is not divisible by parallel.tensor_parallel_size={tp}: "
            f"use a tensor_parallel_size in {_divisors(groups)}"
        )
    if m.kv_channels is None:
        if m.hidden_size % heads:
            raise ConfigError(
                f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={heads}: "
                "change one of them or set model.kv_channels"
            )
        kv_channels = _defaults(m)["kv_channels"]
    else:
        kv_channels = m.kv_channels
    if m.position_embedding == "rope" and kv_channels % 2:
        raise ConfigError(f"rotary embeddings need an even head size, got {kv_channels}: change model.kv_channels or hidden_size")
    return groups, kv_channels


def _ffn_size(cfg: RunConfig, tp: int) -> int:
    m = cfg.model
    ffn = _defaults(m)["ffn_hidden_size"] if m.ffn_hidden_size is None else m.ffn_hidden_size
    if ffn % tp:
        raise ConfigError(
            f"model.ffn_hidden_size={ffn} is not divisible by parallel.tensor_parallel_size={tp}: "
            "set model.ffn_hidden_size to a multiple of it"
        )
    return ffn


def _layers_per_stage(cfg: RunConfig, pp: int, vpp: int) -> Tuple[int, ...]:
    layers, explicit = cfg.model.num_layers, cfg.parallel.layers_per_stage
    stages = pp * vpp
    if explicit is not None:
        explicit = list(explicit)
        if len(explicit) != stages or sum(explicit) != layers or min(explicit) < 1:
            raise ConfigError(
                f"parallel.layers_per_stage={explicit} must have pipeline_parallel_size x virtual_pipeline_size = "
                f"{stages} positive entries summing to model.num_layers={layers}"
            )
        return tuple(explicit)
    if layers % stages:
        raise ConfigError(
            f"model.num_layers={layers} is not divisible by pipeline x virtual pipeline stages = {stages}: "
            "change the stage counts or give parallel.layers_per_stage explicitly"
        )
    return (layers // stages,) * stages


def default_global_batch_size(micro_batch_size: int, dp: int, pp: int) -> int:
    """Megatron's default global batch (micro-batch x dp), times pp: one micro-batch per pipeline
    stage, the fewest that torch's pipeline schedules accept (``_check_pipeline``)."""
    return micro_batch_size * dp * pp


def global_batch_size(cfg: RunConfig) -> int:
    """``data.global_batch_size``, or its default for this layout when it is null."""
    if cfg.data.global_batch_size is not None:
        return cfg.data.global_batch_size
    _check_resolved(cfg)
    _check_positive(cfg)
    _, _, pp, _, dp = _parallel_degrees(cfg)
    return default_global_batch_size(cfg.data.micro_batch_size, dp, pp)


def _num_microbatches(cfg: RunConfig, dp: int, global_batch: int) -> int:
    micro = cfg.data.micro_batch_size
    if global_batch % (micro * dp):
        raise ConfigError(
            f"data.global_batch_size={global_batch} is not divisible by data.micro_batch_size x data-parallel size "
            f"= {micro}x{dp}: use a global_batch_size that is a multiple of {micro * dp}"
        )
    return global_batch // (micro * dp)


def _check_pipeline(cfg: RunConfig, pp: int, vpp: int, dp: int, nmb: int) -> None:
    """What torch.distributed.pipelining's schedules (parallel/pipeline.py) need of the layout."""
    schedule, micro = cfg.parallel.pipeline_schedule, cfg.data.micro_batch_size
    gbs = nmb * micro * dp
    if pp == 1:
        return
    if vpp > 1 and schedule == "1f1b":
        raise ConfigError(
            f"parallel.virtual_pipeline_size={vpp} needs parallel.pipeline_schedule=interleaved_1f1b, zero_bubble "
            "or zbv (1f1b runs one stage per rank): change the schedule or set virtual_pipeline_size=null"
        )
    if schedule == "interleaved_1f1b" and vpp == 1:
        raise ConfigError(
            "parallel.pipeline_schedule=interleaved_1f1b needs parallel.virtual_pipeline_size >= 2: set it, "
            "or use pipeline_schedule=1f1b"
        )
    if schedule == "zbv" and vpp != 2:
        raise ConfigError(
            f"parallel.pipeline_schedule=zbv runs exactly two stages per rank, got parallel.virtual_pipeline_size={vpp}: "
            "set virtual_pipeline_size=2"
        )
    if nmb < pp:
        raise ConfigError(
            f"data.global_batch_size={gbs} gives {nmb} micro-batches per pipeline (global_batch_size / "
            f"(data.micro_batch_size x dp) = {gbs}/({micro}x{dp})), fewer than parallel.pipeline_parallel_size={pp}: "
            f"raise global_batch_size to at least {pp * micro * dp} or lower micro_batch_size"
        )
    if schedule in ("interleaved_1f1b", "zero_bubble") and nmb % max(1, nmb // pp):
        # torch runs the micro-batches in rounds of n // rounds, rounds = max(1, n // pp).
        raise ConfigError(
            f"data.global_batch_size={gbs} gives {nmb} micro-batches, which parallel.pipeline_schedule={schedule} "
            f"cannot split into equal rounds of about pipeline_parallel_size={pp}: use a global_batch_size that "
            f"gives a multiple of {pp} micro-batches (a multiple of {pp * micro * dp})"
        )


def _check_recompute(cfg: RunConfig, layers_per_stage: Tuple[int, ...]) -> None:
    """Megatron's recompute settings: ``num_layers`` counts layers of one pipeline stage (chunk)."""
    rc = cfg.recompute
    if rc.granularity != "full":
        return
    n, largest = rc.num_layers, max(layers_per_stage)
    if n < 1:
        raise ConfigError(f"recompute.num_layers={n} must be a positive integer")
    if rc.method == "block" and n > largest:
        raise ConfigError(
            f"recompute.num_layers={n} exceeds the {largest} layers of a pipeline stage, which recompute.method=block "
            "recomputes at most: lower it, or use recompute.method=uniform"
        )
    if rc.method == "uniform" and any(layers % n for layers in layers_per_stage):
        raise ConfigError(
            f"recompute.num_layers={n} must divide the layers of every pipeline stage {list(layers_per_stage)} "
            f"(recompute.method=uniform checkpoints chunks of that many layers): use one of {_divisors(math.gcd(*layers_per_stage))}"
        )


def _check_arch(cfg: RunConfig, pp: int) -> None:
    """What BERT and T5 (models/bert.py, models/t5.py) support, and the data they need."""
    m, arch = cfg.model, cfg.model.arch
    wanted = {"gpt": ("learned", "rope"), "bert": ("learned",), "t5": ("relative",)}[arch]
    if m.position_embedding not in wanted:
        raise ConfigError(f"model.position_embedding={m.position_embedding!r} does not fit model.arch={arch}: "
                          f"use {' or '.join(wanted)}")
    if arch == "gpt":
        return
    if cfg.parallel.sequence_parallel:
        raise ConfigError(f"parallel.sequence_parallel=true is not supported for model.arch={arch}: set it to false")
    if arch == "t5" and pp > 1:
        raise ConfigError(f"parallel.pipeline_parallel_size={pp}: T5 (an encoder-decoder) runs without pipeline "
                          "parallelism; set it to 1 and use tensor or data parallelism")
    if not cfg.data.name.startswith("indexed"):
        raise ConfigError(f"data.name={cfg.data.name!r}: model.arch={arch} trains on sentence-split indexed data; "
                          f"use data=indexed_{arch} (docs/models.md shows how to make it)")
    if not 0 < cfg.data.masked_lm_prob < 1 or not 0 <= cfg.data.short_seq_prob <= 1:
        raise ConfigError(f"data.masked_lm_prob={cfg.data.masked_lm_prob} must be in (0, 1) and "
                          f"data.short_seq_prob={cfg.data.short_seq_prob} in [0, 1]")
    if cfg.data.mean_noise_span_length < 1:
        raise ConfigError(f"data.mean_noise_span_length={cfg.data.mean_noise_span_length} must be >= 1")
    for key in ("model.num_decoder_layers", "model.decoder_seq_length"):
        if _get(cfg, key) is not None and _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be a positive integer or null (derived)")


def _check_gpu_switches(cfg: RunConfig, tp: int, kv_channels: int, ffn: int) -> None:
    """model.transformer_impl, precision.fp8 and optim.impl (docs/gpu.md): what each runs with.
    Whether this machine has the packages and a GPU is the launcher's preflight check."""
    m, dtype, fp8 = cfg.model, cfg.precision.params_dtype, cfg.precision.fp8
    if m.transformer_impl == "transformer_engine":
        if m.arch != "gpt":
            raise ConfigError(f"model.transformer_impl=transformer_engine runs the GPT family (GPT, Llama); "
                              f"model.arch={m.arch} runs on model.transformer_impl=local")
        if dtype == "float64":
            raise ConfigError("model.transformer_impl=transformer_engine has no float64 kernels: use precision=fp32 "
                              "or bf16, or model.transformer_impl=local")
    if cfg.optim.impl == "apex" and dtype == "float64":
        raise ConfigError("optim.impl=apex (FusedAdam) has no float64 kernel: use optim.impl=auto")
    if fp8 is None:
        return
    if m.transformer_impl != "transformer_engine":
        raise ConfigError("precision.fp8 runs FP8 matmuls through Transformer Engine: set "
                          "model.transformer_impl=transformer_engine, or use precision=bf16")
    if fp8.amax_history_len < 1 or fp8.margin < 0:
        raise ConfigError(f"precision.fp8.amax_history_len={fp8.amax_history_len} must be >= 1 and "
                          f"precision.fp8.margin={fp8.margin} >= 0")
    if cfg.recompute.granularity == "full":
        raise ConfigError("precision.fp8 with recompute.granularity=full is not supported (the replayed forward "
                          "would record its FP8 amaxes again): use recompute.granularity=selective or null")
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    dims = {"model.hidden_size": m.hidden_size, "model.ffn_hidden_size / tp": ffn // tp,
            "heads x kv_channels / tp": heads * kv_channels // tp,
            "(heads + 2 x query groups) x kv_channels / tp": (heads + 2 * groups) * kv_channels // tp,
            "data.micro_batch_size x model.seq_length": cfg.data.micro_batch_size * m.seq_length}
    for what, size in dims.items():
        if size % 16:
            raise ConfigError(f"precision.fp8: Transformer Engine's FP8 matmuls need dimensions divisible by 16, "
                              f"but {what} = {size}: change the model shape or use precision=bf16")


def _check_tp_comm_overlap(cfg: RunConfig) -> None:
    """The collective matmul splits the sequence-parallel collectives (Megatron's rule: no SP, nothing
    to overlap); Transformer Engine's layers bring their own (userbuffers), not wired here."""
    if cfg.parallel.tp_comm_overlap and not cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.tp_comm_overlap=true needs parallel.sequence_parallel=true: set it, "
                          "or parallel.tp_comm_overlap=false")
    if cfg.parallel.tp_comm_overlap and cfg.model.transformer_impl != "local":
        raise ConfigError(f"parallel.tp_comm_overlap=true runs on model.transformer_impl=local, not "
                          f"{cfg.model.transformer_impl}: set parallel.tp_comm_overlap=false")


def _check_context_parallel(cfg: RunConfig, tp: int, cp: int) -> None:
    """What context parallelism (``parallel.context_parallel``) needs: each rank holds chunks ``i``
    and ``2 cp - 1 - i`` of every sequence (then its 1/tp slice under sequence parallelism)."""
    if cp == 1:
        return
    m, par = cfg.model, cfg.parallel
    what = f"parallel.context_parallel_size={cp}"
    if m.arch != "gpt":
        raise ConfigError(f"{what}: model.arch={m.arch} has no context-parallel path (its attention masks are per "
                          "sample): set parallel.context_parallel_size=1, or use the GPT family")
    parts = 2 * cp * (tp if par.sequence_parallel else 1)
    if m.seq_length % parts:
        how = f"2 x cp x tp = {parts} (sequence parallelism)" if par.sequence_parallel else f"2 x cp = {parts}"
        raise ConfigError(f"model.seq_length={m.seq_length} is not divisible by {how}, which {what} needs: "
                          f"use a seq_length that is a multiple of {parts}")
    if par.cp_comm_type == "a2a" and (m.num_attention_heads // tp) % cp:
        raise ConfigError(f"parallel.cp_comm_type=a2a splits each TP rank's {m.num_attention_heads // tp} attention "
                          f"heads over {what}, which does not divide them: use parallel.cp_comm_type=p2p or a "
                          f"context_parallel_size in {_divisors(m.num_attention_heads // tp)}")
    if m.attention_dropout:
        raise ConfigError(f"model.attention_dropout={m.attention_dropout} is not supported with {what} (each "
                          "rank sees its blocks of the attention matrix only): set model.attention_dropout=0")
    if m.transformer_impl != "local":
        raise ConfigError(f"model.transformer_impl={m.transformer_impl} is not supported with {what}: use "
                          "model.transformer_impl=local, or parallel.context_parallel_size=1")


DOCUMENT_KEYS = ("data.eod_mask_loss", "data.reset_position_ids", "data.reset_attention_mask")


def _check_documents(cfg: RunConfig) -> None:
    """The EOD options (``data.packed_documents``) need samples with EOD tokens (GPT samples of
    demo or indexed data); reset positions and document masks reach the local attention only
    (``models.te_layers`` takes neither), and packed fine-tuning data (``data=sft|preference``) always
    carries both."""
    if cfg.data.name in PACKED_DOCUMENT_DATA and cfg.model.transformer_impl != "local":
        raise ConfigError(f"data={cfg.data.name} packs documents with their own positions and attention masks, which "
                          "run in the local attention only: set model.transformer_impl=local (checkpoints load "
                          "under either)")
    on = [key for key in DOCUMENT_KEYS if _get(cfg, key)]
    if not on:
        return
    if cfg.model.arch != "gpt":
        raise ConfigError(f"{on[0]}=true applies to the GPT family: model.arch={cfg.model.arch} builds its own "
                          "samples; set it to false")
    if cfg.data.name not in ("demo", "indexed"):
        raise ConfigError(f"{on[0]}=true needs documents that end with an EOD token, which data.name="
                          f"{cfg.data.name} samples have none of: use data=demo or data=indexed, or set it to false")
    reset = [key for key in DOCUMENT_KEYS[1:] if _get(cfg, key)]
    if reset and cfg.model.transformer_impl != "local":
        raise ConfigError(f"{reset[0]}=true: per-document positions and masks run in the local attention only: "
                          f"set model.transformer_impl=local (checkpoints load under either)")


FSDP_SCHEDULES = ("1f1b",)


def _check_fsdp(cfg: RunConfig, pp: int) -> None:
    """What ``parallel.data_parallel=fsdp`` (``parallel.fsdp``) runs with."""
    if cfg.parallel.data_parallel != "fsdp":
        return
    what = "parallel.data_parallel=fsdp"
    if cfg.optim.distributed_optimizer:
        raise ConfigError(f"{what} already shards the optimizer state over data-parallel ranks: set "
                          "optim.distributed_optimizer=false (or use parallel.data_parallel=ddp for ZeRO-1)")
    if cfg.model.arch != "gpt":
        raise ConfigError(f"{what} runs the GPT family; model.arch={cfg.model.arch}: use parallel.data_parallel=ddp")
    if cfg.model.transformer_impl != "local":
        raise ConfigError(f"{what} is not supported with model.transformer_impl={cfg.model.transformer_impl}: "
                          "use model.transformer_impl=local or parallel.data_parallel=ddp")
    if pp > 1 and (cfg.parallel.pipeline_schedule not in FSDP_SCHEDULES or (cfg.parallel.virtual_pipeline_size or 1) > 1):
        raise ConfigError(f"{what} runs pipeline parallelism with parallel.pipeline_schedule=1f1b and no virtual stages "
                          f"only: set parallel.pipeline_schedule=1f1b parallel.virtual_pipeline_size=null")
    if (pp > 1 or cfg.parallel.tensor_parallel_size > 1) and cfg.mode == "dry_run":
        raise ConfigError(f"mode=dry_run with {what} simulates data parallelism alone (on fake tensors FSDP's first "
                          "forward loses the embedding shard of a TP rank > 0): set parallel.tensor_parallel_size=1 "
                          "parallel.pipeline_parallel_size=1, or parallel.data_parallel=ddp")


def _fp8_recipe(cfg: RunConfig) -> Optional[FP8Recipe]:
    fp8 = cfg.precision.fp8
    return None if fp8 is None else FP8Recipe(**by_name(fp8, FP8Config, FP8Recipe))


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary so that each tensor-parallel shard is a multiple of
    ``divisible_by`` (fast matmul shapes, equal shards)."""
    multiple = divisible_by * tp
    return multiple * math.ceil(vocab_size / multiple)


def _transformer_config(cfg: RunConfig, tp: int, cp: int, **resolved) -> TransformerConfig:
    """Every ``model.*`` key TransformerConfig names, as it is; then the values derive resolved
    (``resolved``: nulls filled in, checked shapes), the family's own, and the other groups'."""
    m, arch = cfg.model, cfg.model.arch
    features = architecture.resolve(cfg)
    family = dict(
        padded_vocab_size=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp),
        softmax_scale=1.0 if arch == "t5" else features.pop("softmax_scale"),
        binary_head=arch == "bert" and m.binary_head,
        num_decoder_layers=(m.num_decoder_layers or m.num_layers) if arch == "t5" else 0,
        decoder_seq_length=(m.decoder_seq_length or m.seq_length) if arch == "t5" else 0,
    )
    others = dict(
        sequence_parallel=cfg.parallel.sequence_parallel, tp_comm_overlap=cfg.parallel.tp_comm_overlap,
        context_parallel_size=cp,
        cp_comm_type=cfg.parallel.cp_comm_type, params_dtype=DTYPES[cfg.precision.params_dtype],
        recompute_granularity=cfg.recompute.granularity, recompute_method=cfg.recompute.method,
        recompute_num_layers=cfg.recompute.num_layers, fp8=_fp8_recipe(cfg),
    )
    return TransformerConfig(**{**by_name(m, ModelConfig, TransformerConfig), **resolved, **features, **family,
                                **others})


def derive(cfg: RunConfig) -> Derived:
    """Validate ``cfg`` and compute everything that follows from it."""
    _check_resolved(cfg)
    _check_choices(cfg)
    check_ranges(cfg)
    _check_positive(cfg)
    check_observability(cfg)
    world, tp, pp, cp, dp = _parallel_degrees(cfg)
    m, par = cfg.model, cfg.parallel
    vpp = par.virtual_pipeline_size or 1
    if vpp > 1 and pp == 1:
        raise ConfigError(
            f"parallel.virtual_pipeline_size={vpp} needs parallel.pipeline_parallel_size > 1: set it to null"
        )
    check_inference(cfg)  # mode=generate/evaluate and trainer.eval: what the inference engine runs
    if par.sequence_parallel:
        if tp == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor_parallel_size > 1: set it to false")
        if m.seq_length % tp:
            raise ConfigError(
                f"model.seq_length={m.seq_length} is not divisible by parallel.tensor_parallel_size={tp}, "
                "which sequence parallelism needs: change seq_length or set parallel.sequence_parallel=false"
            )
    groups, kv_channels = _attention_shape(cfg, tp)
    ffn = _ffn_size(cfg, tp)
    layers = _layers_per_stage(cfg, pp, vpp)
    gbs = cfg.data.global_batch_size or default_global_batch_size(cfg.data.micro_batch_size, dp, pp)
    nmb = _num_microbatches(cfg, dp, gbs)
    try:
        _check_pipeline(cfg, pp, vpp, dp, nmb)
    except ConfigError:
        if cfg.mode != "plan":  # a plan still shows the layout; its table repeats this error as a note
            raise
    _check_recompute(cfg, layers)
    check_compile(cfg)
    _check_arch(cfg, pp)
    _check_gpu_switches(cfg, tp, kv_channels, ffn)
    _check_tp_comm_overlap(cfg)
    _check_fsdp(cfg, pp)
    check_optim(cfg)
    _check_context_parallel(cfg, tp, cp)
    _check_documents(cfg)
    moe, moe_layers = moe_spec(cfg, ffn, dp, tp, cp)
    check_peft(cfg, kv_channels, ffn, moe_layers)
    check_objective(cfg)
    max_pos = m.max_position_embeddings or _defaults(m)["max_position_embeddings"]
    if m.position_embedding == "learned" and m.seq_length > max_pos:
        raise ConfigError(
            f"model.seq_length={m.seq_length} exceeds model.max_position_embeddings={max_pos}: raise the latter"
        )
    decay = cfg.optim.decay_steps or cfg.trainer.max_steps
    if cfg.optim.warmup_steps > decay:
        raise ConfigError(
            f"optim.warmup_steps={cfg.optim.warmup_steps} exceeds the decay length {decay} "
            "(optim.decay_steps, or trainer.max_steps when unset): lower warmup_steps"
        )
    transformer = _transformer_config(cfg, tp, cp, num_query_groups=groups, kv_channels=kv_channels,
                                      ffn_hidden_size=ffn, max_position_embeddings=max_pos, moe=moe,
                                      moe_layers=moe_layers, lora=lora_spec(cfg, moe_layers))
    trainer = cfg.trainer
    split_samples = (trainer.max_steps * gbs, trainer.limit_val_batches * gbs if trainer.val_check_interval else 0, 0)
    return Derived(
        world_size=world, tp=tp, pp=pp, cp=cp, dp=dp, vpp=vpp, num_microbatches=nmb,
        layers_per_stage=layers, transformer=transformer, split_samples=split_samples, global_batch_size=gbs,
        ep=par.expert_parallel_size,
        etp=None if par.expert_tensor_parallel_size in (None, tp) else par.expert_tensor_parallel_size,
    )
