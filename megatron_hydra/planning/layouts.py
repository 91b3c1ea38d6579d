"""Which parallel layout to run a model with on a cluster (``mode=plan_layouts``).

Enumerate every layout the config validation accepts on all of the cluster's GPUs: tensor
parallel within a node (``tp`` divides the GPUs per node), pipeline stages, virtual stages
(interleaved 1F1B), micro-batch size, activation recompute (none, selective, full), sequence
parallelism and the distributed optimizer, and for long sequences (``model.seq_length`` of
``Options.cp_min_seq_length`` or more) context parallelism: powers of two from 2 up to
``Options.max_cp``, ring (p2p) or Ulysses (a2a) exchanges; data parallelism takes the remaining
GPUs, and for a Mixture-of-Experts model expert parallelism is carved from it: every ``ep`` up to
``Options.max_ep`` that divides both the experts and dp, and at tp > 1 with whole experts
(``expert_tensor_parallel_size=1``) every ``ep`` dividing the experts and dp x tp. A layout is kept only if ``derive`` accepts it and the memory plan
(``planning.memory.plan_memory``, the same plan ``mode=plan`` prints) fits the GPU; the survivors
are ranked by the step time of ``planning.performance`` and the best are printed with their MFU
(model FLOPs over the GPU's dense bf16 peak) and the command that runs each. Every model family is
planned (GPT, Llama, MoE, BERT, T5); the layouts a family cannot run (BERT and T5: no sequence or
context parallelism, T5 no pipeline stages, no FSDP: ``config.derive``) never derive. A LoRA job
(``peft=lora``) and a DPO job (``objective=dpo``) are planned and timed as they run: the frozen
base's memory and skipped gradients, the reference model's copy and forward (``planning.frozen``).
This project's overlaps are on in every planned layout where they are available: the gradient
reduce and the parameter gather behind compute (``parallel.overlap_grad_reduce``,
``parallel.overlap_param_gather``) and, with sequence parallelism on the local layers, the ring
collective matmul (``parallel.tp_comm_overlap``); ``overrides`` names each one that differs from
its default, so the printed command runs what was timed.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from megatron_hydra.config import Derived, RunConfig, bundled, derive
from megatron_hydra.config.schema import ClusterConfig
from megatron_hydra.errors import ConfigError
from megatron_hydra.planning.context_parallel import LONG_SEQUENCE
from megatron_hydra.planning.performance import CALIBRATED, Constants, Layout, StepTime, estimate

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = (None, "selective", "full")


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    step: StepTime
    peak_bytes: int  # memory of the fullest rank
    overrides: Tuple[str, ...]  # what to add to the command line to run it


@dataclass(frozen=True)
class Options:
    """What the enumeration may vary (SC21's runs had no sequence parallelism, no distributed
    optimizer, no overlapped gradient reduction and no flash attention: ``benchmarks/planner_sc21.py``
    turns them off). Fused kernels, FP8 and compilation follow the config (``model.transformer_impl``,
    ``precision.fp8``, ``trainer.compile``: compile's GPU gain is not measured yet, so the planner
    never turns it on itself). Layouts with virtual stages (``vpp > 1``) run torch's interleaved
    schedule, whose transfers overlap compute as Megatron-Core's ``overlap_p2p_comm`` does:
    ``pp_comm_overlap`` is on exactly there (``planning.performance``)."""

    micro_batches: Sequence[int] = MICRO_BATCHES
    recompute: Sequence[Optional[str]] = RECOMPUTE
    sequence_parallel: Sequence[bool] = (False, True)
    distributed_optimizer: Sequence[bool] = (False, True)
    data_parallel: Sequence[str] = ("ddp", "fsdp")
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = True  # the ring collective matmul wherever it is available (sequence parallelism, local layers)
    max_vpp: int = 8
    cp_min_seq_length: int = LONG_SEQUENCE
    max_cp: int = 32
    cp_comm_types: Sequence[str] = ("p2p", "a2a")
    max_ep: int = 64
    flash_attention: bool = True  # this project's GPU attention (SDPA / TE); SC21's 2021 code had none


def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _context_parallel(cfg: RunConfig, world: int, opts: Options) -> List[Tuple[int, str]]:
    """(cp, comm type) pairs worth checking: none below ``opts.cp_min_seq_length``; else powers of
    two whose 2 cp chunks divide the sequence (``derive``: load balancing) and the GPUs."""
    out = [(1, "p2p")]
    m = cfg.model
    if m.seq_length < opts.cp_min_seq_length or m.arch != "gpt" or m.attention_dropout:
        return out  # config.derive: context parallelism is GPT-only, without attention dropout
    cp = 2
    while cp <= opts.max_cp and m.seq_length % (2 * cp) == 0 and world % cp == 0:
        out += [(cp, comm) for comm in opts.cp_comm_types]
        cp *= 2
    return out


def _expert_parallel(cfg: RunConfig, dp: int, tp: int, opts: Options) -> List[Tuple[int, bool]]:
    """(ep, whole experts) pairs to check: (1, False) for a dense model; else every ep up to
    ``opts.max_ep`` that divides the experts and dp (experts split over TP like the dense MLP)
    and, at tp > 1, dp x tp (whole experts, ``expert_tensor_parallel_size=1``; ``config.moe``)."""
    moe = cfg.model.moe
    if moe is None:
        return [(1, False)]
    out = []
    for whole, span in ((False, dp), (True, dp * tp)) if tp > 1 else ((False, dp),):
        out += [(ep, whole) for ep in _divisors(span) if ep <= opts.max_ep and moe.num_experts % ep == 0]
    return out


def layouts(cfg: RunConfig, cluster: ClusterConfig, opts: Options = Options()) -> Iterator[Layout]:
    """Every layout shape worth checking; ``derive`` rejects the ones the model cannot take."""
    world = cluster.gpus_per_node * cluster.num_nodes
    layers, gbs = cfg.model.num_layers, cfg.data.global_batch_size
    seq, heads = cfg.model.seq_length, cfg.model.num_attention_heads
    cps = _context_parallel(cfg, world, opts)
    software = dict(flash_attention=opts.flash_attention, fused_kernels=cfg.model.transformer_impl == "transformer_engine",
                    fp8=cfg.precision.fp8 is not None, reference_forward=cfg.objective.name == "dpo",
                    muon_ns_steps=cfg.optim.muon_ns_steps if cfg.optim.name == "muon" else 0,
                    muon_split_qkv=cfg.optim.muon_split_qkv, compiled=cfg.trainer.compile,
                    overlap_grad_reduce=opts.overlap_grad_reduce, overlap_param_gather=opts.overlap_param_gather)
    ring = opts.tp_comm_overlap and cfg.model.transformer_impl != "transformer_engine"  # config.derive: local layers
    for tp, (cp, comm) in itertools.product(_divisors(cluster.gpus_per_node), cps):
        if comm == "a2a" and (heads // tp) % cp:
            continue  # config.derive: Ulysses splits each TP rank's heads over cp
        for pp in (k for k in _divisors(layers) if world % (tp * cp * k) == 0):
            dp = world // (tp * cp * pp)
            vpps = [1] + ([v for v in _divisors(layers // pp) if 1 < v <= opts.max_vpp] if pp > 1 else [])
            for b, vpp, rc, sp, do, mode, (ep, whole) in itertools.product(
                    opts.micro_batches, vpps, opts.recompute, opts.sequence_parallel, opts.distributed_optimizer,
                    opts.data_parallel, _expert_parallel(cfg, dp, tp, opts)):
                fsdp = mode == "fsdp"
                if (gbs % (b * dp) or (sp and tp == 1) or ((do or fsdp) and dp * cp == 1) or (do and fsdp)
                        or (fsdp and cfg.model.moe is not None)  # config.moe: no FSDP with experts
                        or (fsdp and vpp > 1)  # config.derive: FSDP runs 1F1B
                        or (sp and cp > 1 and seq % (2 * cp * tp))  # and CP's chunks split over tp
                        or (rc == "selective" and cp > 1)):  # the same run as none: CP attention is not replayed
                    continue
                yield Layout(tp=tp, pp=pp, dp=dp, micro_batch=b, vpp=vpp, recompute=rc, sequence_parallel=sp,
                             distributed_optimizer=do, fsdp=fsdp, cp=cp, cp_comm=comm, ep=ep, whole_experts=whole,
                             tp_comm_overlap=ring and sp, tp_comm_ring=True, pp_comm_overlap=vpp > 1, **software)


def overrides(layout: Layout) -> Tuple[str, ...]:
    out = [f"parallel.tensor_parallel_size={layout.tp}", f"parallel.pipeline_parallel_size={layout.pp}",
           f"data.micro_batch_size={layout.micro_batch}"]
    if layout.cp > 1:
        out.append(f"parallel.context_parallel_size={layout.cp}")
        if layout.cp_comm != "p2p":
            out.append(f"parallel.cp_comm_type={layout.cp_comm}")
    if layout.ep > 1:
        out.append(f"parallel.expert_parallel_size={layout.ep}")
    if layout.whole_experts:
        out.append("parallel.expert_tensor_parallel_size=1")
    if layout.vpp > 1:
        out += [f"parallel.virtual_pipeline_size={layout.vpp}", "parallel.pipeline_schedule=interleaved_1f1b"]
    if layout.sequence_parallel:
        out.append("parallel.sequence_parallel=true")
    if layout.recompute:
        out.append(f"recompute.granularity={layout.recompute}")
    if layout.distributed_optimizer:
        out.append("optim.distributed_optimizer=true")
    if layout.fsdp:
        out.append("parallel.data_parallel=fsdp")
    if layout.tp_comm_overlap:
        out.append("parallel.tp_comm_overlap=true")
    if not layout.overlap_grad_reduce and layout.dp * layout.cp > 1:
        out.append("parallel.overlap_grad_reduce=false")
    if not layout.overlap_param_gather and layout.distributed_optimizer:
        out.append("parallel.overlap_param_gather=false")
    if layout.compiled:
        out.append("trainer.compile=true")
    return tuple(out)


def layout_config(cfg: RunConfig, cluster: ClusterConfig, layout: Layout) -> RunConfig:
    """``cfg`` run with ``layout`` on every GPU of ``cluster`` in bf16."""
    out = copy.deepcopy(cfg)
    par = out.parallel
    par.tensor_parallel_size, par.pipeline_parallel_size, par.context_parallel_size = layout.tp, layout.pp, layout.cp
    par.cp_comm_type, par.expert_parallel_size = layout.cp_comm, layout.ep
    par.expert_tensor_parallel_size = 1 if layout.whole_experts else None
    par.virtual_pipeline_size = layout.vpp if layout.vpp > 1 else None
    par.pipeline_schedule = "interleaved_1f1b" if layout.vpp > 1 else "1f1b"
    par.sequence_parallel, par.layers_per_stage = layout.sequence_parallel, None
    par.tp_comm_overlap, par.overlap_grad_reduce = layout.tp_comm_overlap, layout.overlap_grad_reduce
    par.overlap_param_gather, out.trainer.compile = layout.overlap_param_gather, layout.compiled
    out.data.micro_batch_size = layout.micro_batch
    out.recompute.granularity = layout.recompute
    out.recompute.method, out.recompute.num_layers = "uniform", 1
    out.optim.distributed_optimizer = layout.distributed_optimizer
    par.data_parallel = "fsdp" if layout.fsdp else "ddp"
    out.precision.params_dtype = "bfloat16"
    tr = out.trainer
    tr.accelerator, tr.devices, tr.num_nodes = "gpu", cluster.gpus_per_node, cluster.num_nodes
    tr.device_memory_gb = cluster.memory_gb
    out.mode = "train"
    return out


def memory_peak(cfg: RunConfig, derived: Derived) -> Tuple[bool, int]:
    """(fits, bytes of the fullest rank) from the memory plan."""
    from megatron_hydra.planning.memory import plan_memory

    plan = plan_memory(cfg, derived, compare=False)
    return plan.fits, plan.peak.total_bytes


def plan_layouts(cfg: RunConfig, cluster: ClusterConfig, opts: Options = Options(), constants: Constants = CALIBRATED,
                 memory: Callable[[RunConfig, Derived], Tuple[bool, int]] = memory_peak) -> List[Candidate]:
    """Every valid layout that fits memory, fastest first. Where no layout derives at all, the
    config itself is wrong (e.g. BERT without its data): the error of the plainest layout (data
    parallel only), else of the first, in one line."""
    found, refused, derived_any = [], None, False
    for layout in layouts(cfg, cluster, opts):
        run_cfg = layout_config(cfg, cluster, layout)
        try:
            derived = derive(run_cfg)
        except ConfigError as e:
            refused = refused or e
            continue
        derived_any = True
        fits, peak = memory(run_cfg, derived)
        if not fits:
            continue
        step = estimate(derived.transformer, derived.global_batch_size, layout, cluster, constants)
        found.append(Candidate(layout, step, peak, overrides(layout)))
    if not derived_any and refused is not None:
        plainest = Layout(tp=1, pp=1, dp=cluster.gpus_per_node * cluster.num_nodes, micro_batch=1)
        try:
            derive(layout_config(cfg, cluster, plainest))
        except ConfigError as e:  # what no layout changes, if the plainest one is refused too
            refused = e
        raise ConfigError(f"no layout of {cluster.name} derives for this config: {refused}")
    found.sort(key=lambda c: c.step.total)
    return found


def _command(base: Sequence[str], cand: Candidate, cluster: ClusterConfig) -> str:
    launcher = ["-m", "hydra/launcher=slurm"] if cluster.num_nodes > 1 else []
    name = "fp8" if cand.layout.fp8 else "bf16"
    precision = [f"precision={name}"] if bundled.has_option("precision", name) else ["precision.params_dtype=bfloat16"]
    trainer = ["trainer=gpu", f"trainer.devices={cluster.gpus_per_node}", f"trainer.num_nodes={cluster.num_nodes}"]
    return " ".join(["python launch.py", *launcher, *base, *precision, *trainer, *cand.overrides])


def describe(layout: Layout) -> str:
    parts = [f"tp={layout.tp}", f"pp={layout.pp}"]
    if layout.cp > 1:
        parts.append(f"cp={layout.cp}" + ("" if layout.cp_comm == "p2p" else f" {layout.cp_comm}"))
    parts.append(f"dp={layout.dp}")
    if layout.ep > 1:
        parts.append(f"ep={layout.ep}")
    if layout.whole_experts:
        parts.append("etp=1")
    parts.append(f"mb={layout.micro_batch}")
    if layout.vpp > 1:
        parts.append(f"vpp={layout.vpp}")
    parts.append(f"recompute={layout.recompute or 'none'}")
    if layout.sequence_parallel:
        parts.append("sp")
    if layout.distributed_optimizer:
        parts.append("dist-opt")
    if layout.fsdp:
        parts.append("fsdp")
    if layout.tp_comm_overlap:
        parts.append("tp-overlap")
    if layout.compiled:
        parts.append("compiled")
    return " ".join(parts)


def report(cfg: RunConfig, cluster: ClusterConfig, found: List[Candidate], base: Sequence[str], top: int = 5) -> str:
    """The best ``top`` layouts: estimated step time, throughput, memory, and the command."""
    gpus = cluster.gpus_per_node * cluster.num_nodes
    lines = [f"{cfg.model.name} on {cluster.name}: {gpus} x {cluster.gpu} ({cluster.num_nodes} nodes of "
             f"{cluster.gpus_per_node}), global batch {cfg.data.global_batch_size} x {cfg.model.seq_length} tokens; "
             f"{len(found)} layouts fit in {cluster.memory_gb:g} GB"]
    if not found:
        lines.append("no layout fits: use more GPUs (cluster.num_nodes) or a smaller global batch / model")
        return "\n".join(lines)
    width = max(52, *(len(describe(c.layout)) for c in found[:top]))
    lines.append(f"{'#':>2}  {'layout':<{width}} {'step s':>8} {'tokens/s':>10} {'model TFLOP/s/GPU':>18} {'MFU':>6}"
                 f" {'hw TFLOP/s/GPU':>15} {'bubble':>7} {'comm':>6} {'mem GiB':>8}")
    for i, cand in enumerate(found[:top], 1):
        st = cand.step
        comm = (st.tp_comm + st.pp_comm + st.dp_comm + st.cp_comm + st.ep_comm) / st.total
        lines.append(f"{i:>2}  {describe(cand.layout):<{width}} {st.total:>8.2f} {st.tokens_per_s:>10.0f} "
                     f"{st.model_tflops_per_gpu:>18.1f} {st.model_tflops_per_gpu / cluster.peak_tflops:>6.1%} "
                     f"{st.tflops_per_gpu:>15.1f} {st.bubble / st.total:>7.1%} "
                     f"{comm:>6.1%} {cand.peak_bytes / 2**30:>8.1f}")
    lines.append("commands:")
    for i, cand in enumerate(found[:top], 1):
        lines.append(f"{i:>2}  {_command(base, cand, cluster)}")
    return "\n".join(lines)


def base_overrides(cfg: RunConfig) -> List[str]:
    """The user's command-line overrides that describe the model and data (the layout keys, mode
    and cluster are the planner's); outside Hydra, the model's and the data's config names."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = list(HydraConfig.get().overrides.task)
    except ValueError:
        return [f"model={cfg.model.name}", *([f"data={cfg.data.name}"] * bundled.has_option("data", cfg.data.name))]
    planned = ("mode=", "cluster=", "cluster.", "parallel", "trainer", "precision", "recompute.", "hydra",
               "data.micro_batch_size=", "optim.distributed_optimizer=")
    return [o for o in task if not o.lstrip("+~").startswith(planned)]


def run_planner(cfg: RunConfig, top: int = 5) -> List[Candidate]:
    """``mode=plan_layouts``: print the best layouts for ``cfg.cluster``."""
    if cfg.cluster is None:
        raise ConfigError("mode=plan_layouts needs a cluster: add cluster=<name> (one of conf/cluster/*.yaml)")
    found = plan_layouts(cfg, cfg.cluster)
    print(report(cfg, cfg.cluster, found, base_overrides(cfg), top))
    return found
