"""``mode=dry_run``: one real training step of the configured job, for chosen ranks, on a CPU.

Each simulated rank joins torch's fake process group at the job's full world size (``fake``
backend: every collective returns at once, every group exists) and runs on a fake GPU
(``training.fake_gpu``): fake tensors on a stand-in accelerator, devices and dtypes checked on
every op. What runs is the real code of a GPU rank: ``ParallelState`` (mesh and every group),
the model stage of this rank, ``MegatronStrategy``'s gradient buffer, the optimizer (fp32 main
weights, distributed optimizer, fp16 loss scaler), the pipeline schedule, one
``training.step.TrainStep`` (forward, backward, optimizer step over every micro-batch of the
global batch) and the checkpoint's save planning (the state dict of logical names and
``torch.distributed.checkpoint``'s local save plan; nothing is written; under ``peft=lora`` the
adapters', as training saves them). With ``objective=dpo`` the step runs the reference model's
forward-only pass first, and the frozen copy it runs without LoRA is built like the policy. So
it fails where the GPU run would: a CPU tensor meeting a GPU one, mixed dtypes under bf16/fp16, a
shape that is wrong at full size, a group that does not exist.

Memory per rank is measured by torch's ``MemTracker`` over the fake tensors, by category, and is
printed beside ``mode=plan``'s row for the same pipeline rank: the state after the step (weights,
grads, fp32 main weights, optimizer state) against the plan's static bytes, and the step's peak
above that (activations and temporaries) against the plan's activations.

Ranks. ``dry_run.ranks`` lists global ranks; by default every distinct position: the first,
one middle and the last pipeline rank, each with the first and the last tensor-parallel rank (the
last holds the vocabulary padding), data-parallel rank 0; with the distributed optimizer also the
last data-parallel rank (whose shard ends the padded buffers). Ranks are simulated one after the
other in this process, or, where this process can use a real accelerator (a GPU host), in a fresh
process of their own: the fake GPU would displace the real one (``fake_gpu.register``).

Limits: point-to-point transfers of the fake group move nothing, so a stage's received activation
is a fresh fake tensor of the announced shape (torch's pipeline stages are given their shapes; a
mismatch surfaces as a shape error in the next op). Transformer Engine and apex kernels do not
exist here: a dry run with them is refused before it starts.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.config.schema import PACKED_DOCUMENT_DATA
from megatron_hydra.data.sequence_shards import shard_batch
from megatron_hydra.errors import ConfigError
from megatron_hydra.parallel.state import ParallelState, coordinates
from megatron_hydra.training import fake_gpu
from megatron_hydra.training.fake_gpu import DryRunError

GIB = 2**30


def batch_fields(arch: str, samples: int, seq: int, decoder_seq: int) -> Dict[str, tuple]:
    """name -> (shape, dtype) of the batch a data-parallel rank receives: what the datasets of
    ``data/`` yield for ``arch``, stacked over ``samples``."""
    int64, f32 = torch.int64, torch.float32
    if arch == "gpt":
        return {"tokens": ((samples, seq), int64), "labels": ((samples, seq), int64), "loss_mask": ((samples, seq), f32)}
    if arch == "bert":
        return {"tokens": ((samples, seq), int64), "labels": ((samples, seq), int64), "loss_mask": ((samples, seq), f32),
                "padding_mask": ((samples, seq), int64), "token_types": ((samples, seq), int64),
                "sop_labels": ((samples,), int64)}
    return {"tokens": ((samples, seq), int64), "padding_mask": ((samples, seq), int64),
            "decoder_tokens": ((samples, decoder_seq), int64), "labels": ((samples, decoder_seq), int64),
            "loss_mask": ((samples, decoder_seq), f32)}


def default_ranks(derived: Derived, distributed_optimizer: bool) -> List[int]:
    """Every distinct rank position (module docstring), as global ranks."""
    strides = {"tp": 1, "dp": derived.tp * derived.cp, "pp": derived.tp * derived.cp * derived.dp}
    pps = sorted({0, derived.pp // 2, derived.pp - 1})
    tps = sorted({0, derived.tp - 1})
    dps = sorted({0, derived.dp - 1}) if distributed_optimizer else [0]
    ranks = {p * strides["pp"] + t * strides["tp"] + (d * strides["dp"] if (p, t) == (0, 0) else 0)
             for p in pps for t in tps for d in dps}
    return sorted(ranks)


@dataclass
class RankResult:
    rank: int
    position: str
    seconds: float
    loss_dtype: str
    state_bytes: Dict[str, int]  # after the step, by MemTracker category
    peak_bytes: int  # the step's peak on the device
    save_peak_bytes: int  # peak while the checkpoint's state dict and save plan are built
    host_peak_bytes: int  # fake CPU tensors (e.g. initialisation's draws)
    host_syncs: List[str] = field(default_factory=list)
    plan_static_bytes: int = 0
    plan_activation_bytes: int = 0
    headroom_bytes: int = 0  # the plan's for this rank beyond tensors: CUDA context, NCCL, fragmentation
    save_items: int = 0
    optimizer_step_bytes: int = 0  # optim=muon: its step's peak above what was live when it started
    plan_step_bytes: int = 0  # the plan's for it (optim=muon's transient; planning.muon)

    @property
    def static_bytes(self) -> int:
        return sum(self.state_bytes.values())

    @property
    def needed_bytes(self) -> int:
        """What the device must have for this rank: the measured step peak plus the plan's headroom
        that no tensor shows (the cross-entropy transient is a tensor: it is in the peak)."""
        return max(self.peak_bytes, self.save_peak_bytes) + self.headroom_bytes


def _device_bytes(snapshot: dict, device_type: str) -> Dict[str, int]:
    for device, values in snapshot.items():
        if torch.device(device).type == device_type:
            return {str(k).split(".")[-1]: int(v) for k, v in values.items()}
    return {}


def _memory_tracker():
    """torch's ``MemTracker`` (per device and category: parameters, gradients, optimizer state,
    activations, temporaries), without its per-module statistics, which refuse a module that runs
    more than once a step (every micro-batch runs every layer)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class DeviceTotals(MemTracker):
        def _pre_fw_hook(self, *args, **kwargs) -> None:
            pass

        def _post_fw_hook(self, *args, **kwargs) -> None:
            pass

        def _pre_bw_hook(self, *args, **kwargs) -> None:
            pass

        def _post_bw_hook(self, *args, **kwargs) -> None:
            pass

        def reset_peak(self) -> None:
            """Start a new peak from the current bytes (as entering the tracker does)."""
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}

    return DeviceTotals()


def _fake_batch(cfg: RunConfig, derived: Derived, ps: ParallelState) -> Dict[str, torch.Tensor]:
    tcfg = derived.transformer
    samples = derived.global_batch_size // derived.dp  # this data-parallel rank's share
    fields = batch_fields(tcfg.arch, samples, tcfg.seq_length, tcfg.decoder_seq_length)
    # Host tensors, as the DataLoader yields them (this cp rank's chunks); the strategy moves them
    # to the device.
    batch = {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in fields.items()}
    # The EOD options add their fields (data.packed_documents), so the step runs the masked attention.
    # Packed fine-tuning data (data=sft) always carries both.
    for key, name in (("reset_position_ids", "position_ids"), ("reset_attention_mask", "document_ids")):
        if tcfg.arch == "gpt" and (getattr(cfg.data, key) or cfg.data.name in PACKED_DOCUMENT_DATA):
            batch[name] = torch.zeros(batch["tokens"].shape, dtype=torch.int64)
    return shard_batch(batch, ps.cp_size, ps.cp_rank)


def _save_plan(module, optimizer, ps: ParallelState, derived: Derived) -> int:
    """The checkpoint's state dict and this rank's local save plan (what ``dcp.save`` plans
    before writing; under LoRA the adapters alone, as training saves them); returns the number of
    items planned."""
    from megatron_hydra.checkpoint.chunks import SavePlanner
    from megatron_hydra.checkpoint.plan import saved_part
    from megatron_hydra.checkpoint.sharded import state_dict

    sd = state_dict(module.model, optimizer, ps, derived.transformer.vocab_size, select=saved_part(derived))
    planner = SavePlanner()
    planner.set_up_planner(sd, is_coordinator=dist.get_rank() == 0)
    return len(planner.create_local_plan().items)


def _forget_meshes() -> None:
    """Drop DTensor's cache of sharding decisions (FSDP's parameters are DTensors). It compares
    meshes by their layout, not by their process groups, so the next simulated rank in this process
    would get back DTensors on this rank's mesh, whose groups are gone with its process group."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # its C++ twin
    if clear_native is not None:
        clear_native()


def _name_default_backend() -> None:
    """Tell the group which of its backends is its default (torch's fake one, a custom backend).
    Given one backend per device type, ``init_process_group`` names a default only for NCCL, gloo or
    a plugin it finds by its upper-case name, which misses ``fake``; ``destroy_process_group`` then
    asks for the default's hooks and C++ prints "No backend of type 0 found" on stderr."""
    from torch.distributed import ProcessGroup

    dist.group.WORLD._set_default_backend(ProcessGroup.BackendType.CUSTOM)


def simulate_rank(cfg: RunConfig, derived: Derived, rank: int) -> RankResult:
    """One training step of global rank ``rank`` on the fake group and the fake GPU."""
    with warnings.catch_warnings():
        # Fake tensors have no data; torch warns whenever something reads a data pointer of one
        # (DCP's planner and Lightning do, harmlessly).
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        return _simulate_rank(cfg, derived, rank)


def _simulate_rank(cfg: RunConfig, derived: Derived, rank: int) -> RankResult:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_hydra.parallel.random import seed_model_parallel, stage_seed
    from megatron_hydra.planning.memory import rank_memory
    from megatron_hydra.training.module import LMModule
    from megatron_hydra.training.step import TrainStep
    from megatron_hydra.training.strategy import MegatronStrategy

    start = time.perf_counter()
    device = fake_gpu.register()
    # The fake backend for host tensors and for the stand-in GPU's (its collectives return at once).
    dist.init_process_group(f"cpu:fake,{device.type}:fake", store=FakeStore(), rank=rank, world_size=derived.world_size)
    _name_default_backend()
    try:
        # The mesh is built from real (host) rank tables, before anything turns fake.
        ps = ParallelState.build(tp=derived.tp, pp=derived.pp, dp=derived.dp, cp=derived.cp, device_type=device.type,
                             ep=derived.ep, etp=derived.etp)
        seed_model_parallel(stage_seed(cfg.seed, ps.pp_rank), ps.tp_rank)  # as training does: dropout draws from it
        with fake_gpu.fake_gpu() as check:
            tracker = _memory_tracker()
            with tracker:
                with torch.device(device):
                    module = LMModule(cfg, derived, ps)
                strategy = MegatronStrategy(ps, device, grad_bucket_size=cfg.parallel.grad_bucket_size,
                                            distributed_optimizer=cfg.optim.distributed_optimizer,
                                            data_parallel=cfg.parallel.data_parallel,
                                            overlap_grad_reduce=cfg.parallel.overlap_grad_reduce)
                strategy.connect(module)
                strategy.wrap_model(module)
                optimizer = module.build_optimizer(strategy.grad_buffer)
                optimizer.init_state()  # the steady step: Adam's state exists before it starts
                tracker.track_external(module, optimizer)
                tracker.reset_peak()  # the step's own peak (initialisation fills a tensor in one chunk here)
                batch = strategy.batch_to_device(_fake_batch(cfg, derived, ps), device)
                syncs_before = len(check.host_syncs)
                with _optimizer_peak(tracker, optimizer, device.type) as optimizer_peak:
                    loss = TrainStep(module, optimizer)(batch, step=0).loss  # the guard records it, as in training
                step_syncs = check.host_syncs[syncs_before:]
                state = _device_bytes(tracker.get_tracker_snapshot("current"), device.type)
                peak = {"Total": max(_device_bytes(tracker.get_tracker_snapshot("peak"), device.type).get("Total", 0),
                                     optimizer_peak["before"])}
                host_peak = _device_bytes(tracker.get_tracker_snapshot("peak"), "cpu")
                tracker.reset_peak()
                # FSDP checkpoints are not written yet (config.derive refuses to train with them).
                save_items = _save_plan(module, optimizer, ps, derived) if strategy.grad_buffer is not None else 0
                save_peak = _device_bytes(tracker.get_tracker_snapshot("peak"), device.type)
            optimizer.close()
            if strategy.grad_buffer is not None:
                strategy.grad_buffer.close()
    finally:
        dist.destroy_process_group()
        _forget_meshes()
    coords = coordinates(rank, ps.sizes)
    plan = rank_memory(cfg, derived, coords["pp"])
    state.pop("Total", None)
    position = f"pp{coords['pp']} tp{coords['tp']} dp{coords['dp']}" + (f" cp{coords['cp']}" if derived.cp > 1 else "")
    return RankResult(
        rank=rank, position=position, seconds=time.perf_counter() - start,
        loss_dtype=str(loss.dtype).replace("torch.", ""), state_bytes=state, peak_bytes=peak.get("Total", 0),
        save_peak_bytes=save_peak.get("Total", 0), host_peak_bytes=host_peak.get("Total", 0), host_syncs=step_syncs,
        plan_static_bytes=plan.static_bytes,
        plan_activation_bytes=plan.activation_bytes,
        headroom_bytes=plan.context_bytes + plan.nccl_bytes + plan.fragmentation_bytes, save_items=save_items,
        optimizer_step_bytes=optimizer_peak["step"], plan_step_bytes=plan.step_transient_bytes)


@contextlib.contextmanager
def _optimizer_peak(tracker, optimizer, device_type: str):
    """Measures the peak of Muon's part of the optimizer step (``optim=muon``) above the bytes live
    when it starts (``step``; the tracker's peak restarts there), and the peak before it
    (``before``: forward, backward, clipping and AdamW)."""
    out = {"step": 0, "before": 0}
    muon = getattr(optimizer, "muon", None)
    if muon is None:
        yield out
        return
    step = muon.step

    def measured(*args, **kwargs):
        out["before"] = max(out["before"], _device_bytes(tracker.get_tracker_snapshot("peak"), device_type).get("Total", 0))
        live = _device_bytes(tracker.get_tracker_snapshot("current"), device_type).get("Total", 0)
        tracker.reset_peak()
        try:
            return step(*args, **kwargs)
        finally:
            peak = _device_bytes(tracker.get_tracker_snapshot("peak"), device_type).get("Total", 0)
            out["step"] = max(out["step"], peak - live)

    muon.step = measured  # this instance only, for this one step
    try:
        yield out
    finally:
        del muon.step


def check_runnable(cfg: RunConfig) -> None:
    """What the fake GPU cannot run, refused in one line before anything starts."""
    impl = getattr(cfg.model, "transformer_impl", "local")
    if impl != "local":
        raise ConfigError(f"mode=dry_run runs model.transformer_impl=local only (got {impl!r}: its kernels need a GPU): "
                          "set model.transformer_impl=local, or check it with scripts/gpu_check.sh on a GPU")
    if dist.is_initialized():
        raise ConfigError("mode=dry_run starts its own fake process group: run it from launch.py, not inside a worker")
    if cfg.model.attention_dropout and cfg.recompute.granularity:
        # torch aborts the process when the replay draws attention dropout on the stand-in device
        raise ConfigError(f"mode=dry_run cannot replay attention dropout under recompute.granularity="
                          f"{cfg.recompute.granularity} on the fake GPU: set model.attention_dropout=0 for the dry run "
                          "(it changes no shape or byte), or check that combination on a GPU")


def dry_run(cfg: RunConfig, derived: Derived, ranks: Optional[Sequence[int]] = None) -> List[RankResult]:
    check_runnable(cfg)
    sharded = cfg.optim.distributed_optimizer or cfg.parallel.data_parallel == "fsdp"
    ranks = list(ranks) if ranks else default_ranks(derived, sharded)
    bad = [r for r in ranks if not 0 <= r < derived.world_size]
    if bad:
        raise ConfigError(f"dry_run.ranks={bad} are outside the job's {derived.world_size} ranks: use 0..{derived.world_size - 1}")
    if fake_gpu.registered():
        return [simulate_rank(cfg, derived, r) for r in ranks]
    return _in_own_process(cfg, derived, ranks)


def _in_own_process(cfg: RunConfig, derived: Derived, ranks: List[int]) -> List[RankResult]:
    """The ranks simulated in a fresh process that registers the fake GPU before anything else,
    for a process that can use a real accelerator (``fake_gpu.register``) and stays able to."""
    return run_in_own_process(_simulate_in_own_process, cfg, derived, ranks)


def run_in_own_process(fn, *args):
    """``fn(*args)`` in a fresh (spawned) process: its result, or the error it raised, comes back
    here; a process that dies without one is a ``DryRunError``."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool:
            raise DryRunError("the dry run's own process ended without a result: its output above says why") from None


def _simulate_in_own_process(cfg: RunConfig, derived: Derived, ranks: List[int]) -> List[RankResult]:
    fake_gpu.register(own_process=True)
    return [simulate_rank(cfg, derived, r) for r in ranks]


def table(cfg: RunConfig, derived: Derived, results: List[RankResult], device: Optional[DeviceMemory] = None) -> str:
    """Measured bytes per rank beside ``mode=plan``'s (GiB); with ``device``, what each rank needs
    against it, a rank that does not fit marked ``!``."""
    cp = f" x cp {derived.cp}" if derived.cp > 1 else ""
    head = (f"dry run: model={cfg.model.name}, {derived.world_size} ranks = tp {derived.tp} x pp {derived.pp}{cp} x dp "
            f"{derived.dp}; {cfg.precision.params_dtype}; {derived.num_microbatches} micro-batches of "
            f"{cfg.data.micro_batch_size}; one step per rank on the fake process group and a fake GPU")
    cols = ("state", "plan state", "ratio", "step peak", "activations", "plan act.", "save peak", "needs", "syncs",
            "seconds")
    lines = [head, f"{'rank':>6} {'position':<16}" + "".join(f"{c:>12}" for c in cols) + "   (GiB)"]
    for r in results:
        act = max(0, r.peak_bytes - r.static_bytes)
        ratio = r.static_bytes / r.plan_static_bytes if r.plan_static_bytes else float("nan")
        values = (f"{r.static_bytes / GIB:.2f}", f"{r.plan_static_bytes / GIB:.2f}", f"{ratio:.3f}",
                  f"{r.peak_bytes / GIB:.2f}", f"{act / GIB:.2f}", f"{r.plan_activation_bytes / GIB:.2f}",
                  f"{r.save_peak_bytes / GIB:.2f}", f"{r.needed_bytes / GIB:.2f}", str(len(r.host_syncs)),
                  f"{r.seconds:.1f}")
        flag = " !" if device is not None and r.needed_bytes > device.bytes else ""
        lines.append(f"{r.rank:>6} {r.position:<16}" + "".join(f"{v:>12}" for v in values) + flag)
    if any(r.plan_step_bytes for r in results):
        lines.append("optim=muon, its step's peak above the state (measured / plan, MiB): " + "; ".join(
            f"rank {r.rank} {r.optimizer_step_bytes / 2**20:.2f} / {r.plan_step_bytes / 2**20:.2f}" for r in results))
    syncs = sorted({s for r in results for s in r.host_syncs})
    if syncs:
        lines.append("host syncs in the step (a GPU waits for each): " + "; ".join(syncs))
    lines.append("state = weights + grads + fp32 main weights + optimizer state + pipeline buffers after the step "
                 "(MemTracker); activations = step peak - state; needs = the larger of step and save peak + the "
                 "plan's headroom beyond tensors (CUDA context, NCCL buffers, allocator fragmentation)")
    if device is not None:
        worst = max(results, key=lambda r: r.needed_bytes)
        short = [r for r in results if r.needed_bytes > device.bytes]
        verdict = f"{len(short)} of {len(results)} ranks do NOT fit (marked !)" if short else "every rank fits"
        lines.append(f"device memory {device.bytes / GIB:.2f} GiB ({device.source}); needs up to "
                     f"{worst.needed_bytes / GIB:.2f} GiB on rank {worst.rank}: {verdict}")
    return "\n".join(lines)


@dataclass
class DeviceMemory:
    """One GPU's memory as the dry run compares it, and the config the memory plan is asked with
    for fixes (its ``trainer.device_memory_gb`` set where the size came from ``cluster=``)."""

    bytes: int
    source: str
    cfg: RunConfig


def device_memory(cfg: RunConfig) -> DeviceMemory:
    """The GPU of ``cluster=`` when one is given (its ``memory_gb``, read as ``mode=plan_layouts``
    reads it), else the trainer's GPU as ``mode=plan`` knows it (``planning.memory.device_memory``:
    ``trainer.device_memory_gb``, the GPU's report, or the assumed size)."""
    from megatron_hydra.planning.memory import device_memory as plan_device_memory

    if cfg.cluster is not None and cfg.trainer.device_memory_gb is None:
        sized = copy.deepcopy(cfg)
        sized.trainer.device_memory_gb = cfg.cluster.memory_gb
        return DeviceMemory(int(cfg.cluster.memory_gb * GIB), f"cluster={cfg.cluster.name}: {cfg.cluster.gpu}", sized)
    size, source = plan_device_memory(cfg)
    return DeviceMemory(size, source, cfg)


def check_fits(derived: Derived, results: List[RankResult], device: DeviceMemory) -> None:
    """One-line ConfigError naming the ranks that need more than a device has, and the single
    changes the memory plan suggests (``planning.fit.fixes``, cheapest first)."""
    from megatron_hydra.planning.fit import fixes
    from megatron_hydra.planning.memory import plan_memory

    short = [r for r in results if r.needed_bytes > device.bytes]
    if not short:
        return
    worst = max(short, key=lambda r: r.needed_bytes)
    plan = plan_memory(device.cfg, derived)
    suggestions = fixes(device.cfg, derived, plan) or ["a larger trainer.devices x trainer.num_nodes or a smaller model"]
    ranks = ", ".join(str(r.rank) for r in short)
    raise ConfigError(
        f"mode=dry_run: rank{'s' * (len(short) > 1)} {ranks} need{'s' * (len(short) == 1)} up to "
        f"{worst.needed_bytes / GIB:.2f} GiB (rank {worst.rank}, {worst.position}) but a device has "
        f"{device.bytes / GIB:.2f} GiB ({device.source}), short by {(worst.needed_bytes - device.bytes) / GIB:.2f} GiB: "
        f"the memory plan suggests {'; or '.join(suggestions)} (trainer.device_memory_gb overrides the device size)")


def stand_in_config(cfg: RunConfig, ranks: Optional[Sequence[int]] = None) -> tuple:
    """``(config, notes)``: the job as the dry run steps it, what only a GPU runs swapped for its
    CPU stand-in (the same shapes and bytes), each swap said in a note: one micro-batch per
    pipeline stage (the same peak; the plan's columns are the full step's), the local layers for
    Transformer Engine's (and bf16 for FP8), no attention dropout under recompute (its replay aborts
    on the stand-in device). ``ranks``: the ranks to step; None: the distinct positions."""
    from megatron_hydra.config.derive import default_global_batch_size, derive

    dry, notes = copy.deepcopy(cfg), []
    dry.mode = "dry_run"
    dry.dry_run.ranks = list(ranks) if ranks else None
    derived = derive(cfg)
    short = default_global_batch_size(cfg.data.micro_batch_size, derived.dp, derived.pp)
    if derived.global_batch_size > short:
        dry.data.global_batch_size = short
        notes.append(f"the dry run steps data.global_batch_size={short} ({derived.pp} micro-batches per "
                     f"data-parallel rank, not {derived.num_microbatches}, for time); the plan is the full step's")
    if dry.model.transformer_impl != "local":
        dry.model.transformer_impl = "local"
        notes.append("the dry run runs model.transformer_impl=local (Transformer Engine's kernels need a GPU)")
        if dry.precision.fp8 is not None:
            dry.precision.fp8 = None
            notes.append("...and bf16 without FP8 (FP8 is Transformer Engine's)")
    if dry.recompute.granularity and dry.model.attention_dropout:
        dry.model.attention_dropout = 0.0
        notes.append("the dry run sets model.attention_dropout=0 (dropout under recompute aborts on its stand-in "
                     "device; no shape or byte changes)")
    return dry, notes


def run_dry_run(cfg: RunConfig, derived: Derived) -> List[RankResult]:
    """``mode=dry_run``: simulate, print the table, return the results; a ConfigError after the
    table when a rank needs more than a device has (``check_fits``)."""
    device = device_memory(cfg)
    results = dry_run(cfg, derived, cfg.dry_run.ranks)
    print(table(cfg, derived, results, device))
    check_fits(derived, results, device)
    return results
