"""Bytes per rank of a run, from the config alone: the plan behind ``mode=plan`` and the launcher's
"does not fit" check. Nothing here allocates memory or needs a process group.

Parameters (exact). Each pipeline rank's model chunks are built on the meta device at tp=1 from the
run's ``TransformerConfig`` (whose padded vocabulary already belongs to the run's tp), with the
model class of its family (GPT, BERT, T5: ``planning.memory_archs``). A parameter
tagged with a ``tp_partition_dim`` holds 1/tp of its logical tensor on every TP rank (the parallel
layers shard evenly, which ``models.init`` relies on too); the others are whole on every TP rank.
TP ranks are therefore symmetric, and so are DP ranks: the plan has one row per pipeline rank,
neighbours with identical rows merged. Builds are cached by (shape, layer count, first/last stage).

Model and optimizer state (the byte rules, all in ``state_bytes``). N is the rank's parameter count,
``dtype`` is ``precision.params_dtype``:

    weights        N x itemsize(dtype)
    grads          N x 4 for bfloat16/float16 (an fp32 grad buffer), else N x itemsize(dtype)
    main weights   N x 4 for bfloat16/float16 (fp32 copies the optimizer updates), else 0
    optimizer      Adam's exp_avg and exp_avg_sq: 2 x N x 4 (2 x N x 8 for float64)

With ``optim.distributed_optimizer`` the main weights and the optimizer state cover only this DP
rank's shard of its flat parameter buffer: N becomes ceil(N / dp) for those two (dp here and below
is the dp x cp ranks that hold the same weights and reduce gradients together). Precisely, the
flat buffers are cut into buckets (``parallel.grad_bucket_size``) each padded to a multiple of dp
(``parallel.data_parallel.bucket_layout``, which the plan calls with the rank's parameters in
buffer order): the shard is 1/dp of every padded bucket (ceil(N / dp) for a single bucket), and the
weights and grads take the padded length. (Adam's per-tensor ``step`` counters, 4 bytes per
parameter tensor, are left out.) ``optim=muon`` keeps one momentum buffer instead of Adam's two
moments for the layers' hidden matrices, and its step a transient of its own: ``planning.muon``. With ``parallel.data_parallel=fsdp`` all four are sharded and a
working set of gathered blocks is added: ``planning.fsdp``. Mixture-of-Experts models (experts per
EP rank, their own buckets, their activations): ``planning.moe``.

Buffers (exact, ``buffers``): what the same meta builds hold besides parameters, each attention's
rotary cos and sin tables ([seq, head size] in the parameter dtype, one pair per layer), whole on
every TP rank and never in a checkpoint.

Activations (Korthikanti et al. 2022): the bytes a layer, the embedding and the head keep per
micro-batch, and the conventions the plan computes them in, are ``planning.activations``.

Context parallelism (c = ``parallel.context_parallel_size``; ``planning.context_parallel``): a rank
holds s/c tokens of every sequence, so every per-token term above (and below: outside the layers,
pipeline buffers, cross-entropy transient) takes s/c; the attention terms take the rank's s/c
queries against all s keys (unfused: a (s/c) s b (2v + m) / t; fused: 4 a (s/c) b / t). A rank's
activations are 1/c of those at c = 1, plus two terms the dry run measures: rotary embeddings
gather cos and sin at the rank's positions (2 v (s/c) b d, a view of the table at c = 1), and a2a
keeps attention's output in the head layout as well (v (s/c) b a d / t). Selective recompute
does not replay context-parallel attention, so at c > 1 it keeps the fused term. Its exchange buffers (``cp bufs``, once per rank,
one layer's attention at a time): p2p 4 K/V blocks of 2 b (s/c)(g/t) d v bytes; a2a 4 tensors of
b (a/(t c)) s d v bytes.

Outside the layers (Korthikanti's and Megatron's accounting; BERT's and T5's own terms, T5's
encoder and decoder stacks and its cross-attention: ``planning.memory_archs``): the first stage
keeps the token ids (8 sb) and the embedding-dropout mask (m sbh r); the last stage the final norm's input (v sbh r),
the LM head's input (v sbh: replicated, or gathered under SP) and the logits the cross entropy
keeps (v sbV/t: fp32, fp64 and bf16 ones become their exponentials, fp16 ones are kept as they are)
with its targets (8 sb).

Pipeline buffers (``pipeline_buffer_bytes``): torch's pipeline stages allocate, once, a receive
buffer per micro-batch for the activation they receive and another for the gradient that comes
back, n x v sbh r each (n micro-batches per step), as the dry run finds them.

Pipeline in-flight micro-batches (activations a rank holds at its peak), each a chunk's worth:
1F1B: pipeline rank i holds min(pp - i, n) micro-batches (n = micro-batches per step); interleaved
(and zero-bubble, which runs the same warm-up): 2 (pp - i - 1) + (vpp - 1) pp + 1 chunk
micro-batches, at most n vpp (Megatron's warm-up; for rank 0 it is Megatron's
(1 + (pp - 1)/(pp vpp)) x pp stages' worth); ZB-V: 2 pp chunks, as 1F1B's first stage. pp = 1: one.

Headroom: what a rank needs beyond the tensors above, each a named constant below with its source.
The cross-entropy transient on the last stage (``parallel.cross_entropy``): 16-bit logits take their
exponentials in one fp32 buffer of b s w entries (w vocabulary entries a slice, ``vocab_chunks``),
forward and backward, which writes their gradient over them: 4 b s w bytes (b micro-batch, s the
full sequence, s/c under context parallelism); none for fp32 and fp64 logits, which become their
exponentials, then the gradient. On GPUs also the CUDA
context of the process, NCCL's buffers and the caching allocator's fragmentation. The fit check
compares the planned bytes plus headroom with the device (``MemoryPlan.fits``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from megatron_hydra.config.derive import Derived
from megatron_hydra.config.schema import PACKED_DOCUMENT_DATA, RunConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.errors import ConfigError
from megatron_hydra.parallel.cross_entropy import vocab_chunks
from megatron_hydra.parallel.device import this_rank_device
from megatron_hydra.parallel.pipeline import stage_indices, stage_layers
from megatron_hydra.parallel.recompute import recomputed_chunks
from megatron_hydra.planning import context_parallel, frozen
from megatron_hydra.planning.memory_archs import (StackBytes, chunk_buffer_bytes, chunk_parameters, outside_layers,
                                                  stacks)
from megatron_hydra.planning import moe
from megatron_hydra.planning.moe import chunk_ranges
from megatron_hydra.planning.state_bytes import GATED_ACTIVATIONS, shape_only, state_bytes
from megatron_hydra.planning.flops import loss_tokens, model_flops_per_step

GIB = 2**30
# A GPU config planned on a machine without one: the memory of an 80 GB A100/H100.
ASSUMED_GPU_MEMORY_GB = 80.0

# Headroom on GPUs (module docstring): published figures, each value says where it comes from.
# The CUDA context of one process (driver state, the kernels it loads, cuBLAS workspaces): about
# 0.5 GiB for a torch training process on A100/H100-class GPUs with CUDA 12, whose lazy loading
# (CUDA_MODULE_LOADING=LAZY, the default on Linux since CUDA 12.2: CUDA C++ Programming Guide,
# "Lazy Loading") loads only the kernels a process uses, where eager loading took 1 GiB and more.
CUDA_CONTEXT_BYTES = GIB // 2
# NCCL's buffers: NCCL_BUFFSIZE (4 MiB by default: NCCL's environment-variable documentation) for
# each peer connection of each channel, a ring channel connecting a rank to two peers (previous and
# next), up to NCCL_MAX_NCHANNELS channels per communicator (32: NCCL's MAXCHANNELS, which NVSwitch
# nodes use), one communicator per process group of more than one rank that this rank runs
# collectives on. Bytes = NCCL_BUFFSIZE x channels x 2 peers x communicators (``nccl_communicators``);
# the LL/LL128 protocol buffers are left out, and so are connections NCCL never opens.
NCCL_BUFFSIZE = 4 * 2**20
NCCL_CHANNELS = 32
NCCL_RING_PEERS = 2
# The caching allocator's fragmentation: memory it holds but cannot hand out, as a fraction of
# what it holds. Guo et al., "GMLake" (ASPLOS 2024), measure PyTorch's caching allocator on eight
# LLM fine-tuning/training setups on A100-80GB and remove 15% fragmentation on average (up to 33%),
# so 15% of reserved memory is fragmentation: planned bytes x 0.15 / (1 - 0.15) on top of them.
ALLOCATOR_FRAGMENTATION = 0.15


# Byte rules -------------------------------------------------------------------------------------

def flat_buffer(numels: List[int], bucket_size: int, dp: int, distributed_optimizer: bool) -> Tuple[int, int]:
    """(padded length, this rank's shard) of the flat buffers over parameters of ``numels`` (in
    the model's parameter order), as ``parallel.data_parallel`` lays them out."""
    if not distributed_optimizer:
        return sum(numels), sum(numels)
    from megatron_hydra.parallel.data_parallel import bucket_layout

    layout = bucket_layout(list(reversed(numels)), bucket_size, dp)  # the buffer runs in reverse order
    return layout[-1][3], sum((end - start) // dp for _, _, start, end in layout)


# Parameters ---------------------------------------------------------------------------------------

def chunk_numels(tcfg: TransformerConfig, num_layers: int, pre: bool, post: bool, tp: int,
                 trains: Optional[bool] = None) -> List[int]:
    """Element counts of the parameters one TP rank holds of a model chunk of ``num_layers``
    layers, in the model's parameter order (a dense model; ``planning.moe`` for experts).
    ``trains``: only those that train (True) or only the frozen (False: LoRA's base), else all."""
    return [n // tp if sharded else n for n, sharded, adapter in chunk_parameters(shape_only(tcfg), num_layers, pre, post)
            if trains is None or (tcfg.lora is None or adapter) == trains]


def rank_chunks(cfg: RunConfig, derived: Derived, pp_rank: int) -> List[Tuple[int, bool, bool]]:
    """(layers, first stage, last stage) of each model chunk pipeline rank ``pp_rank`` holds."""
    per_stage = derived.layers_per_stage
    if derived.pp == 1:
        return [(sum(per_stage), True, True)]
    stages = stage_indices(pp_rank, derived.pp, derived.vpp, cfg.parallel.pipeline_schedule)
    return [(len(stage_layers(per_stage, s)), s == 0, s == len(per_stage) - 1) for s in stages]


# Activations --------------------------------------------------------------------------------------

def _layer_shape(cfg: RunConfig, derived: Derived) -> dict:
    """``activation_bytes_per_layer`` arguments for this run, in the plan's conventions."""
    tc, gpu = derived.transformer, cfg.trainer.accelerator == "gpu"
    v = tc.params_dtype.itemsize
    return dict(seq=tc.seq_length, micro_batch=cfg.data.micro_batch_size, hidden=tc.hidden_size,
                heads=tc.num_attention_heads, tp=derived.tp, sequence_parallel=tc.sequence_parallel,
                ffn_hidden=tc.ffn_hidden_size, query_groups=tc.num_query_groups, kv_channels=tc.kv_channels,
                gated=tc.activation in GATED_ACTIVATIONS, relu=tc.activation == "relu", value_bytes=v,
                mask_bytes=1 if gpu else v,
                hidden_dropout=tc.hidden_dropout > 0, attention_dropout=tc.attention_dropout > 0,
                attention="fused" if gpu or tc.attention_dropout == 0 else "unfused", sp_gathered_inputs=True,
                rotary=tc.position_embedding == "rope", cp=derived.cp, cp_comm=tc.cp_comm_type,
                document_mask=cfg.data.reset_attention_mask or cfg.data.name in PACKED_DOCUMENT_DATA, qk_norm=tc.qk_norm,
                post_norms=tc.post_sublayer_norm, zero_centered=tc.zero_centered_gamma,
                softcap=tc.attn_logit_softcapping is not None,
                positions=cfg.data.reset_position_ids or cfg.data.name in PACKED_DOCUMENT_DATA)


def _chunk_activations(tc: TransformerConfig, chunk_stacks: List[StackBytes]) -> Tuple[float, float]:
    """(bytes a micro-batch leaves in a chunk of these stacks, extra bytes of a backward replay).
    Stacks run in the given order, so the backward replays stack k after the later stacks have
    freed theirs: the peak is the largest (stacks up to k + a region of k); the extra is that
    peak less what all stacks keep (below zero where a later stack's bytes outweigh the replay).
    Selective recompute replays one layer's core attention at a time (soft-capped scores make it
    large)."""
    stored, peak = [], 0.0
    for st in chunk_stacks:
        kept = replay = 0.0
        if tc.recompute_granularity == "selective":
            kept, replay = st.layers * st.selective, max(0.0, st.full - st.selective) * (st.layers > 0)
        elif tc.recompute_granularity != "full":
            kept = st.layers * st.full
        else:
            for start, end, recomputed in recomputed_chunks(st.layers, "full", tc.recompute_method, tc.recompute_num_layers):
                kept += st.checkpointed if recomputed else (end - start) * st.full
                replay = max(replay, (end - start) * st.full if recomputed else 0.0)
        stored.append(kept)
        peak = max(peak, sum(stored) + replay)
    return sum(stored), peak - sum(stored)


def pipeline_buffer_bytes(cfg: RunConfig, derived: Derived, pp_rank: int) -> int:
    """Receive buffers torch's pipeline stages keep for the whole run: one per micro-batch for the
    activation each stage receives (all but the first stage) and one per micro-batch for the
    gradient it receives back (all but the last), each [micro_batch, seq/cp (/tp under SP),
    hidden] in the parameter dtype. A neighbour stage on the same rank (ZB-V's turn) hands over
    directly. DPO's reference pass runs a pipeline of its own, whose stages keep as many."""
    if derived.pp == 1:
        return 0
    tc = derived.transformer
    seq = tc.seq_length // derived.cp // (derived.tp if tc.sequence_parallel else 1)
    one = cfg.data.micro_batch_size * seq * tc.hidden_size * tc.params_dtype.itemsize
    schedule, last = cfg.parallel.pipeline_schedule, len(derived.layers_per_stage) - 1
    stages = stage_indices(pp_rank, derived.pp, derived.vpp, schedule)
    remote = [n for s in stages for n in (s - 1, s + 1) if 0 <= n <= last and n not in stages]
    return len(remote) * derived.num_microbatches * one * (2 if cfg.objective.name == "dpo" else 1)


def in_flight(schedule: str, pp: int, vpp: int, pp_rank: int, num_microbatches: int) -> int:
    """Chunk forwards (micro-batch x model chunk) whose activations pipeline rank ``pp_rank``
    holds at once at its peak (module docstring)."""
    if pp == 1:
        return 1
    if schedule == "1f1b":
        return min(pp - pp_rank, num_microbatches)
    if schedule == "zbv":
        return min(2 * pp, 2 * num_microbatches)
    return min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1, num_microbatches * vpp)


# Headroom -----------------------------------------------------------------------------------------

def cross_entropy_transient_bytes(micro_batch: int, seq: int, padded_vocab: int, tp: int,
                                  logits_dtype: torch.dtype) -> int:
    """Bytes the loss of one micro-batch holds at once beyond the logits it keeps (module
    docstring): for 16-bit logits one fp32 slice (their gradient is written over them); none for fp32 and fp64."""
    if logits_dtype.itemsize >= 4:
        return 0
    tokens = micro_batch * seq
    slice_width = vocab_chunks(padded_vocab // tp, tokens)[0][1]
    return 4 * tokens * slice_width


def nccl_communicators(derived: Derived, first_or_last: bool, tied: bool) -> List[str]:
    """The process groups of more than one rank that a rank runs NCCL collectives on (each its own
    communicator, even where two groups hold the same ranks)."""
    names = [name for name, size in (("tp", derived.tp), ("pp", derived.pp), ("cp", derived.cp),
                                      ("dp_cp", derived.dp * derived.cp),
                                      ("model", derived.tp * derived.pp), ("world", derived.world_size), ("ep", derived.ep),
                                      ("edp_cp", _expert_dp(derived))) if size > 1]
    if derived.pp > 1 and tied and first_or_last:
        names.append("embedding")
    return names


def _expert_dp(derived: Derived) -> int:
    from megatron_hydra.planning.moe import expert_dp_size

    return expert_dp_size(derived) or 0


def _headroom(cfg: RunConfig, derived: Derived, row: "RankMemory", last: bool, first_or_last: bool) -> "RankMemory":
    tc = derived.transformer
    transient = cross_entropy_transient_bytes(cfg.data.micro_batch_size, loss_tokens(tc) // derived.cp,
                                              tc.padded_vocab_size, derived.tp, tc.params_dtype) if last else 0
    row = dataclasses.replace(row, transient_bytes=transient)
    if cfg.trainer.accelerator != "gpu":
        return row
    comms = len(nccl_communicators(derived, first_or_last, tc.tie_embeddings))
    fragmentation = (row.total_bytes + transient) * ALLOCATOR_FRAGMENTATION / (1 - ALLOCATOR_FRAGMENTATION)
    return dataclasses.replace(row, context_bytes=CUDA_CONTEXT_BYTES,
                               nccl_bytes=NCCL_BUFFSIZE * NCCL_CHANNELS * NCCL_RING_PEERS * comms,
                               fragmentation_bytes=round(fragmentation))


# The plan -----------------------------------------------------------------------------------------

@dataclass
class RankMemory:
    position: str
    params: int
    weight_bytes: int
    grad_bytes: int
    main_weight_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    pipeline_buffer_bytes: int = 0
    gathered_bytes: int = 0  # FSDP: unsharded weights and grads while a step runs (planning.fsdp)
    cp_buffer_bytes: int = 0  # context parallelism's exchange buffers (planning.context_parallel)
    buffer_bytes: int = 0  # the model's buffers: each attention's rotary cos/sin tables
    frozen_params: int = 0  # of ``params``, LoRA's frozen base: weights alone (planning.frozen)
    reference_bytes: int = 0  # objective=dpo without LoRA: the frozen reference copy (planning.frozen)
    # Headroom (module docstring): not in ``total_bytes``, in ``needed_bytes``.
    transient_bytes: int = 0
    context_bytes: int = 0
    nccl_bytes: int = 0
    fragmentation_bytes: int = 0
    step_transient_bytes: int = 0  # optim=muon: its step's gathered update and Newton-Schulz temporaries

    @property
    def static_bytes(self) -> int:
        """What a rank holds from its first step to its last (all but the activations)."""
        return (self.weight_bytes + self.grad_bytes + self.main_weight_bytes + self.optimizer_bytes
                + self.pipeline_buffer_bytes + self.buffer_bytes + self.reference_bytes)

    @property
    def total_bytes(self) -> int:
        """The planned tensors: what the rank holds at its peak besides transients."""
        return self.static_bytes + self.gathered_bytes + self.activation_bytes + self.cp_buffer_bytes

    @property
    def step_beyond_bytes(self) -> int:
        """What the optimizer step's transient needs beyond the larger peak of the forward and
        backward (it runs once their activations are freed, on top of the static bytes)."""
        return max(0, self.step_transient_bytes - (self.total_bytes - self.static_bytes) - self.transient_bytes)

    @property
    def headroom_bytes(self) -> int:
        return (self.transient_bytes + self.step_beyond_bytes + self.context_bytes + self.nccl_bytes
                + self.fragmentation_bytes)

    @property
    def needed_bytes(self) -> int:
        """What the device must have: the planned tensors plus headroom."""
        return self.total_bytes + self.headroom_bytes


@dataclass
class MemoryPlan:
    ranks: List[RankMemory]
    device_bytes: int
    title: str = ""
    device_source: str = ""
    notes: List[str] = field(default_factory=list)

    @property
    def peak(self) -> RankMemory:
        """The rank that needs the most (planned tensors plus headroom)."""
        return max(self.ranks, key=lambda r: r.needed_bytes)

    @property
    def fits(self) -> bool:
        return self.peak.needed_bytes <= self.device_bytes

    def table(self) -> str:
        gathered = any(r.gathered_bytes for r in self.ranks)  # FSDP's column
        cp = any(r.cp_buffer_bytes for r in self.ranks)  # context parallelism's column
        tables = any(r.buffer_bytes for r in self.ranks)  # the rotary tables' column
        lora = any(r.frozen_params for r in self.ranks)  # the trained parameters' column
        ref = any(r.reference_bytes for r in self.ranks)  # DPO's reference copy
        cols = ("params", *(("trained",) * lora), "weights", "grads", "main wts", "optimizer",
                *(("buffers",) * tables), *(("reference",) * ref), "p2p bufs",
                *(("gathered",) * gathered), "activations", *(("cp bufs",) * cp), "total", "headroom", "needs")
        width = max(14, *(len(r.position) + 2 for r in self.ranks))
        unit, size = ("GiB", GIB) if self.peak.needed_bytes >= GIB else ("MiB", 2**20)
        lines = [self.title] if self.title else []
        lines.append(f"{'rank position':<{width}}" + "".join(f"{c:>12}" for c in cols) + f"   ({unit})")
        for r in self.ranks:
            values = (r.weight_bytes, r.grad_bytes, r.main_weight_bytes, r.optimizer_bytes,
                      *((r.buffer_bytes,) * tables), *((r.reference_bytes,) * ref), r.pipeline_buffer_bytes,
                      *((r.gathered_bytes,) * gathered), r.activation_bytes, *((r.cp_buffer_bytes,) * cp),
                      r.total_bytes, r.headroom_bytes, r.needed_bytes)
            counts = (r.params, *((r.params - r.frozen_params,) * lora))
            lines.append(f"{r.position:<{width}}" + "".join(f"{_count(n):>12}" for n in counts)
                         + "".join(f"{x / size:>12.2f}" for x in values))
        peak = self.peak
        lines += self._headroom_rows(unit, size)
        short = (peak.needed_bytes - self.device_bytes) / GIB
        verdict = "fits" if self.fits else f"does NOT fit: short by {short:.2f} GiB"
        lines.append(f"device memory {self.device_bytes / GIB:.2f} GiB ({self.device_source}); "
                     f"needs {peak.needed_bytes / GIB:.2f} GiB on {peak.position} "
                     f"(planned {peak.total_bytes / GIB:.2f} + headroom {peak.headroom_bytes / GIB:.2f}): {verdict}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def _headroom_rows(self, unit: str, size: int) -> List[str]:
        """The headroom of the rank that needs the most, item by item (module docstring)."""
        peak = self.peak
        if not peak.headroom_bytes:
            return []
        per_comm = NCCL_BUFFSIZE * NCCL_CHANNELS * NCCL_RING_PEERS
        items = [("cross-entropy transient", peak.transient_bytes,
                  "one fp32 slice of 16-bit logits, last stage only"),
                 ("Muon step transient", peak.step_beyond_bytes,
                  f"beyond the activations, of {peak.step_transient_bytes / size:.2f} (planning.muon)"),
                 ("CUDA context", peak.context_bytes, "per process, CUDA 12 with lazy loading"),
                 ("NCCL buffers", peak.nccl_bytes,
                  f"{NCCL_BUFFSIZE >> 20} MiB x {NCCL_CHANNELS} channels x {NCCL_RING_PEERS} peers x "
                  f"{peak.nccl_bytes // per_comm} communicators"),
                 ("allocator fragmentation", peak.fragmentation_bytes,
                  f"{ALLOCATOR_FRAGMENTATION:.0%} of reserved memory: planned x {ALLOCATOR_FRAGMENTATION:g}"
                  f"/{1 - ALLOCATOR_FRAGMENTATION:g}")]
        rows = [f"headroom on {peak.position} ({unit}):"]
        shown = [item for item in items if item[1] or (peak.context_bytes and item[0] != "Muon step transient")]
        rows += [f"  {name:<26}{value / size:>8.2f}   {how}" for name, value, how in shown]
        return rows


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _host_memory() -> int:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def device_memory(cfg: RunConfig) -> Tuple[int, str]:
    """Bytes of one device and where the number comes from: ``trainer.device_memory_gb`` (GiB), the
    GPU's reported memory, or on CPU the machine's RAM (cgroup limit included) over the local ranks."""
    trainer = cfg.trainer
    if trainer.device_memory_gb is not None:
        if trainer.device_memory_gb <= 0:
            raise ConfigError(f"trainer.device_memory_gb={trainer.device_memory_gb} must be > 0, or null to read it from the device")
        return int(trainer.device_memory_gb * GIB), "trainer.device_memory_gb"
    if trainer.accelerator == "gpu":
        if torch.cuda.is_available():  # this rank's own GPU: under torchrun/srun it is not always cuda:0
            return torch.cuda.get_device_properties(this_rank_device("gpu")).total_memory, "reported by the GPU"
        return int(ASSUMED_GPU_MEMORY_GB * GIB), "assumed, no GPU visible: set trainer.device_memory_gb"
    return _host_memory() // trainer.devices, f"host RAM / {trainer.devices} local ranks"


def _position(pp_rank: int, pp: int, chunks) -> str:
    if pp == 1:
        return "every rank"
    roles = [role for role, present in (("first", any(c[1] for c in chunks)), ("last", any(c[2] for c in chunks))) if present]
    return f"pp{pp_rank}" + (f" ({'+'.join(roles)} stage)" if roles else "")


def rank_memory(cfg: RunConfig, derived: Derived, pp_rank: int) -> RankMemory:
    """The plan's row of pipeline rank ``pp_rank`` (any of its TP and DP ranks)."""
    layer = _layer_shape(cfg, derived)
    return _rank_memory(cfg, derived, pp_rank, layer, outside_layers(cfg, derived, layer))


def _rank_memory(cfg: RunConfig, derived: Derived, pp_rank: int, layer: dict, outside) -> RankMemory:
    tc = derived.transformer
    chunks = rank_chunks(cfg, derived, pp_rank)
    gathered, moe, fixed = 0, tc.moe is not None, 0  # fixed: LoRA's frozen base (planning.frozen)
    if moe:
        from megatron_hydra.planning.moe import rank_state

        trained, fixed, (weights, grads, main, optimizer) = rank_state(cfg, derived, pp_rank, chunks)
    elif cfg.parallel.data_parallel == "fsdp":
        from megatron_hydra.planning.fsdp import chunk_params, fsdp_state_bytes

        held = [p for layers, pre, post in chunks for p in chunk_params(tc, layers, pre, post, derived.tp)]
        trained = sum(n for n, _, _ in held)
        weights, grads, main, optimizer, gathered = fsdp_state_bytes(held, tc.params_dtype, derived.dp * derived.cp,
                                                                     derived.pp, derived.num_microbatches)
    else:
        numels = [n for layers, pre, post in chunks for n in chunk_numels(tc, layers, pre, post, derived.tp, trains=True)]
        fixed = sum(n for layers, pre, post in chunks for n in chunk_numels(tc, layers, pre, post, derived.tp, False))
        padded, shard = flat_buffer(numels, cfg.parallel.grad_bucket_size, derived.dp * derived.cp,
                                    cfg.optim.distributed_optimizer)
        trained = sum(numels)
        weights, grads, main, optimizer = state_bytes(trained, tc.params_dtype, shard, padded, fixed)
    params = trained + fixed
    optimizer, step_transient = _muon(cfg, derived, pp_rank, optimizer)
    per_chunk = [_chunk_activations(tc, stacks(tc, layer, len(r), r.start)) for r in chunk_ranges(cfg, derived, pp_rank)]
    if moe:  # each MoE layer's terms in place of its dense MLP's (planning.moe)
        from megatron_hydra.planning.moe import chunk_activation_deltas as deltas
        per_chunk = [(s + ds, r + dr) for (s, r), (ds, dr) in zip(per_chunk, deltas(cfg, derived, pp_rank, layer))]
    flight = in_flight(cfg.parallel.pipeline_schedule, derived.pp, derived.vpp, pp_rank, derived.num_microbatches)
    per_chunk_flight = math.ceil(flight / len(chunks))
    activations = flight * sum(stored for stored, _ in per_chunk) / len(chunks) + max(replay for _, replay in per_chunk)
    embedding, head = outside
    activations += per_chunk_flight * (embedding * any(c[1] for c in chunks) + head * any(c[2] for c in chunks))
    buffers = _buffer_bytes(cfg, derived, pp_rank, chunks)
    shards = derived.dp * derived.cp if cfg.parallel.data_parallel == "fsdp" else 1
    row = RankMemory(_position(pp_rank, derived.pp, chunks), params, weights, grads, main, optimizer,
                     round(activations), pipeline_buffer_bytes(cfg, derived, pp_rank), gathered,
                     context_parallel.rank_buffer_bytes(cfg, derived), buffers, frozen_params=fixed,
                     reference_bytes=frozen.reference_bytes(cfg.objective.name, tc, params, buffers, shards),
                     step_transient_bytes=step_transient)
    first, last = any(c[1] for c in chunks), any(c[2] for c in chunks)
    return _headroom(cfg, derived, row, last, first != last)


def _layer_chunks(cfg: RunConfig, derived: Derived, pp_rank: int) -> List[tuple]:
    """(layers range, first stage, last stage) of each model chunk of pipeline rank ``pp_rank``."""
    return [(layers, pre, post) for (_, pre, post), layers in zip(rank_chunks(cfg, derived, pp_rank),
                                                                  chunk_ranges(cfg, derived, pp_rank))]


def _muon(cfg: RunConfig, derived: Derived, pp_rank: int, optimizer: int) -> Tuple[int, int]:
    """(optimizer state, the step's transient) of pipeline rank ``pp_rank``: under ``optim=muon``
    one momentum buffer where Adam keeps two moments, over Muon's matrices (``planning.muon``)."""
    if cfg.optim.name != "muon":
        return optimizer, 0
    from megatron_hydra.planning import muon

    tc, chunks = derived.transformer, _layer_chunks(cfg, derived, pp_rank)
    matrices = muon.rank_matrices(tc, chunks, derived.ep)
    main = muon.main_item(tc.params_dtype)
    ns = muon.ns_item(tc.params_dtype, cfg.trainer.accelerator == "gpu")
    transient = muon.transient_bytes(matrices, derived.tp, main, ns, derived.etp is not None)
    if cfg.optim.distributed_optimizer:  # whole matrices owned per DP (or expert DP) rank: the busiest rank
        edp = moe.expert_dp_size(derived) if tc.moe is not None else None
        return muon.distributed_optimizer_state(tc, chunks, derived.tp, derived.dp * derived.cp,
                                                cfg.parallel.grad_bucket_size, main, derived.ep, edp,
                                                derived.etp is not None, derived.cp), transient
    momentum = muon.local_elements(matrices, derived.tp, derived.etp is not None) * main
    return optimizer - momentum, transient


def _buffer_bytes(cfg: RunConfig, derived: Derived, pp_rank: int, chunks) -> int:
    """The buffers of the rank's model chunks, as built (``memory_archs.chunk_buffer_bytes``)."""
    tc = derived.transformer
    if tc.moe is None:
        return sum(chunk_buffer_bytes(shape_only(tc), layers, pre, post) for layers, pre, post in chunks)
    return sum(moe.chunk_buffer_bytes(tc, layers, pre, post, derived.ep)
               for (_, pre, post), layers in zip(chunks, chunk_ranges(cfg, derived, pp_rank)))


def _merge(rows: List[RankMemory]) -> List[RankMemory]:
    """Neighbouring middle pipeline ranks with identical rows become one row ``ppA-B``."""
    out: List[RankMemory] = []
    last = None  # position of the first rank of the current run of identical rows
    for row in rows:
        prev = out[-1] if out else None
        same = prev is not None and dataclasses.astuple(row)[1:] == dataclasses.astuple(prev)[1:]
        if same and "stage" not in row.position and "stage" not in prev.position:
            out[-1] = dataclasses.replace(prev, position=f"{last}-{row.position[2:]}")
        else:
            out.append(row)
            last = row.position
    return out


def _title(cfg: RunConfig, derived: Derived) -> str:
    rc = cfg.recompute
    recompute = "none" if rc.granularity is None else rc.granularity
    if rc.granularity == "full":
        recompute += f" ({rc.method}, {rc.num_layers})"
    return (f"memory plan: model={cfg.model.name}, {derived.world_size} ranks = tp {derived.tp} x pp {derived.pp}"
            f"{f' (vpp {derived.vpp})' if derived.vpp > 1 else ''} x dp {derived.dp}"
            f"{f' x cp {derived.cp} ({cfg.parallel.cp_comm_type})' if derived.cp > 1 else ''}"
            f"{', sequence parallel' if derived.transformer.sequence_parallel else ''}; "
            f"micro-batch {cfg.data.micro_batch_size} x seq {derived.transformer.seq_length}"
            f"{f' (decoder {derived.transformer.decoder_seq_length})' if derived.transformer.arch == 't5' else ''}, "
            f"{derived.num_microbatches} micro-batches/step; {cfg.precision.params_dtype}; recompute {recompute}; "
            + ("FSDP" if cfg.parallel.data_parallel == "fsdp" else
               f"distributed optimizer {'on' if cfg.optim.distributed_optimizer else 'off'}"))


def checkpoint_share_bytes(cfg: RunConfig, derived: Derived, row: RankMemory) -> int:
    """What a rank writes to a checkpoint (``checkpoint.sharded``: its own pieces; state that
    data-parallel ranks replicate is split over them), and so what an asynchronous save stages in
    host memory: weights in their own dtype, fp32 main weights and Adam state."""
    dp = derived.dp * derived.cp
    state = row.main_weight_bytes + row.optimizer_bytes
    if cfg.parallel.data_parallel == "fsdp":
        return row.weight_bytes + state
    saved = row.weight_bytes - row.frozen_params * derived.transformer.params_dtype.itemsize  # LoRA: the adapters
    return saved // dp + (state if cfg.optim.distributed_optimizer else state // dp)


def plan_memory(cfg: RunConfig, derived: Derived, compare: bool = True) -> MemoryPlan:
    """Bytes per distinct rank position of the run ``cfg`` (module docstring). ``compare=False``:
    no note that plans the run again with every weight trained (LoRA; the layout search's and the
    fit check's many plans need none)."""
    device_bytes, source = device_memory(cfg)
    layer = _layer_shape(cfg, derived)
    outside = outside_layers(cfg, derived, layer)
    rows = [_rank_memory(cfg, derived, i, layer, outside) for i in range(derived.pp)]
    notes = []
    if derived.pp > 1:
        from megatron_hydra.config.derive import _check_pipeline

        try:
            _check_pipeline(cfg, derived.pp, derived.vpp, derived.dp, derived.num_microbatches)
        except ConfigError as e:
            notes.append(f"training would refuse this layout: {e}")
    if cfg.checkpoint.async_save:
        staged = max(checkpoint_share_bytes(cfg, derived, r) for r in rows)
        notes.append(f"checkpoint.async_save: a rank stages its share of a checkpoint in host memory "
                     f"({'pinned, ' if cfg.trainer.accelerator == 'gpu' else ''}up to {staged / 2**30:.2f} GiB), "
                     "not on the device")
    notes += frozen.plan_notes(cfg, derived, rows, plan_memory if compare else None)
    if cfg.optim.name == "muon":
        from megatron_hydra.planning.muon import plan_note

        notes.append(plan_note(cfg, derived, [_layer_chunks(cfg, derived, i) for i in range(derived.pp)]))
    flops = model_flops_per_step(derived.transformer, derived.global_batch_size, cfg.objective.name == "dpo")
    notes.append(f"model FLOPs per step (global batch {derived.global_batch_size}): {flops:.3e}")
    return MemoryPlan(_merge(rows), device_bytes, _title(cfg, derived), source, notes)
