"""The job shrunk for ``mode=verify``: the same architecture, feature switches and layout
(tp x pp x cp x ep, virtual stages, schedule), in float64, with the fewest layers and the smallest
widths that keep every divisibility ``derive`` checks, so that gloo ranks on one CPU run it in
seconds and any difference from one process is the layout's, not the noise of float32."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import List

from megatron_hydra.config import Derived, RunConfig, derive
from megatron_hydra.errors import ConfigError, one_line

HEAD_DIM = 8  # per attention head: even (rotary embeddings) and a multiple of every power-of-two tp
VOCAB = 100  # tokens; padded by make_vocab_size_divisible_by x tp as the job's vocabulary is
VOCAB_DIVISIBLE_BY = 8
SEQ_PER_CP_CHUNK = 8  # tokens in each of a rank's two context-parallel chunks


@dataclass
class Shrunk:
    """The shrunk config, its derived values, and what it changed of the job's layout (one line
    each, for the verdict)."""

    cfg: RunConfig
    derived: Derived
    reduced: List[str] = field(default_factory=list)


def check_verifiable(cfg: RunConfig) -> None:
    """What verify cannot shrink, refused in one line before the float64 runs (exact, resume);
    the fit check alone never shrinks the job, so these pass it."""
    if cfg.model.arch != "gpt":
        raise ConfigError(f"mode=verify trains the GPT family on synthetic tokens; model.arch={cfg.model.arch} trains "
                          "on sentence-split indexed data only: check it with mode=dry_run and its own tests")
    if cfg.objective.name != "lm":
        raise ConfigError(f"mode=verify trains objective=lm on synthetic tokens; objective={cfg.objective.name} needs "
                          "preference pairs: verify the job with objective=lm, its layout is the same")
    if cfg.model.transformer_impl != "local":
        raise ConfigError("mode=verify runs in float64 on CPU ranks, which model.transformer_impl=transformer_engine "
                          "lacks: verify with model.transformer_impl=local (the same math)")


def _dp(job_dp: int, ep: int, span_factor: int, at_least_two: bool) -> int:
    """The smallest data-parallel size that the expert split needs (``ep`` divides dp x
    ``span_factor``), at least 2 when the job's DP path is to be exercised."""
    dp = 2 if at_least_two and job_dp > 1 else 1
    while (dp * span_factor) % ep:
        dp += 1
    return dp


def _heads(cfg: RunConfig, tp: int, cp: int) -> tuple:
    """(heads, query groups): the job's GQA ratio, the fewest groups that tp divides (and, for
    cp_comm_type=a2a, heads per TP rank that cp divides)."""
    m = cfg.model
    groups = m.num_query_groups or m.num_attention_heads
    ratio = m.num_attention_heads // groups
    new_groups = tp if tp > 1 else min(2, groups)  # two heads at least where the job has them
    if cfg.parallel.cp_comm_type == "a2a" and cp > 1:
        while (ratio * new_groups // tp) % cp:
            new_groups += tp
    return ratio * new_groups, new_groups


def _seq(tp: int, cp: int, sequence_parallel: bool) -> int:
    seq = SEQ_PER_CP_CHUNK * 2 * cp
    while sequence_parallel and (seq // cp) % tp:
        seq += 2 * cp
    return seq


def _shrink_model(cfg: RunConfig, tp: int, pp: int, cp: int, vpp: int, reduced: List[str]) -> None:
    m = cfg.model
    pattern = m.sliding_window_pattern if isinstance(m.sliding_window_pattern, int) else 1
    m.num_layers = math.lcm(2 * pp * vpp, max(1, pattern))
    if cfg.parallel.layers_per_stage is not None:  # the job's split sums to its own layer count
        reduced.append(f"parallel.layers_per_stage={list(cfg.parallel.layers_per_stage)} -> null (an even split of "
                       f"the shrunk {m.num_layers} layers)")
        cfg.parallel.layers_per_stage = None
    _shrink_recompute(cfg, m.num_layers // (pp * vpp), reduced)
    heads, groups = _heads(cfg, tp, cp)
    m.num_attention_heads = heads
    m.num_query_groups = groups if m.num_query_groups is not None or groups != heads else None
    m.kv_channels = HEAD_DIM if m.kv_channels is not None else None
    m.hidden_size = heads * HEAD_DIM
    m.ffn_hidden_size = 2 * m.hidden_size
    m.seq_length = _seq(tp, cp, cfg.parallel.sequence_parallel or bool(m.moe))
    m.max_position_embeddings = None
    if m.sliding_window is not None:
        m.sliding_window = m.seq_length // 2 - 1  # binding: shorter than the sequence, odd across chunks
    m.vocab_size, m.make_vocab_size_divisible_by = VOCAB, VOCAB_DIVISIBLE_BY
    m.hidden_dropout = m.attention_dropout = 0.0  # dropout masks are drawn per rank: not layout-exact
    if m.moe is not None:
        ep = cfg.parallel.expert_parallel_size
        m.moe.num_experts = min(m.moe.num_experts, ep * math.ceil((m.moe.top_k + 1) / ep))
        m.moe.num_experts = max(m.moe.num_experts, ep, m.moe.top_k)
        m.moe.ffn_hidden_size = m.hidden_size if m.moe.ffn_hidden_size else None
        if m.moe.shared_ffn_hidden_size:
            m.moe.shared_ffn_hidden_size = m.hidden_size
        if not isinstance(m.moe.layer_freq, int):  # a per-layer list: its first layers (dense ones first)
            freq = list(m.moe.layer_freq)
            m.moe.layer_freq = [freq[min(i, len(freq) - 1)] for i in range(m.num_layers)]


def _shrink_recompute(cfg: RunConfig, per_stage: int, reduced: List[str]) -> None:
    """``recompute.num_layers`` counts layers of a stage (chunk): a job's valid count may exceed the
    shrunk stage's ``per_stage`` layers (block) or not divide them (uniform). Clamped to the most
    that still recompute (block: all of the stage; uniform: the largest chunk that divides it), so
    the recompute path runs rather than the shrink failing."""
    rc = cfg.recompute
    if rc.granularity != "full":
        return
    n = rc.num_layers
    if rc.method == "block":
        n = min(n, per_stage)
    else:
        n = max(c for c in range(1, min(n, per_stage) + 1) if per_stage % c == 0)
    if n != rc.num_layers:
        reduced.append(f"recompute.num_layers {rc.num_layers} -> {n} (recompute.method={rc.method} on the shrunk "
                       f"{per_stage} layers per stage)")
        rc.num_layers = n


def _shrink_run(cfg: RunConfig, world: int, steps: int, run_dir: str) -> None:
    cfg.mode = "train"
    cfg.run_dir = run_dir
    cfg.precision.name, cfg.precision.params_dtype, cfg.precision.fp8 = "fp64", "float64", None
    cfg.data.name, cfg.data.micro_batch_size, cfg.data.global_batch_size = "synthetic", 1, None
    cfg.data.eod_mask_loss = cfg.data.reset_position_ids = cfg.data.reset_attention_mask = False
    cfg.data.num_workers, cfg.data.packing = 0, False
    t = cfg.trainer
    t.accelerator, t.devices, t.num_nodes, t.max_steps = "cpu", world, 1, steps
    t.log_every_n_steps, t.enable_progress_bar, t.val_check_interval = 1, False, 0
    t.generate_sample_tokens, t.logger, t.profile_steps, t.peak_tflops = 0, ["csv"], None, 1.0
    t.eval.every_n_steps, t.eval.tasks, t.device_memory_gb, t.num_threads = 0, [], None, 1
    c = cfg.checkpoint
    c.dir, c.every_n_steps, c.keep_last, c.resume, c.load = f"{run_dir}/checkpoints", 1, 0, "none", None
    c.async_save = False
    cfg.peft.adapter = None
    cfg.optim.warmup_steps = min(cfg.optim.warmup_steps, 1)
    cfg.optim.decay_steps = steps + 1  # one schedule for runs of steps and steps + 1 (the resume's)
    cfg.optim.impl = "auto"


def shrink(job: RunConfig, job_derived: Derived, run_dir: str) -> Shrunk:
    """The job at its tp x pp x cp x ep with the smallest DP, ranks cut to ``verify.max_ranks``
    (DP first, then pipeline stages; never TP, CP or EP), ``verify.steps`` optimizer steps."""
    check_verifiable(job)
    d, par = job_derived, job.parallel
    tp, pp, cp, ep, vpp = d.tp, d.pp, d.cp, d.ep, d.vpp
    span = tp if (par.expert_tensor_parallel_size == 1 and tp > 1) else 1
    dp, reduced = _dp(d.dp, ep, span, True), []
    limit = job.verify.max_ranks
    if tp * pp * cp * dp > limit and dp > 1:
        dp = _dp(d.dp, ep, span, False)
        reduced.append(f"dp {d.dp} -> {dp} (verify.max_ranks={limit})")
    elif dp < d.dp:
        reduced.append(f"dp {d.dp} -> {dp} (the smallest that exercises data parallelism)")
    new_pp = pp
    while tp * new_pp * cp * dp > limit and new_pp > 1:
        new_pp = new_pp // 2 if new_pp % 2 == 0 and new_pp // 2 >= 2 else (new_pp - 1 if new_pp > 2 else 1)
    if new_pp != pp:
        reduced.append(f"pp {pp} -> {new_pp} (verify.max_ranks={limit}; tp, cp and ep are never reduced)")
    if tp * new_pp * cp * dp > limit:
        raise ConfigError(f"mode=verify: tp x cp x dp = {tp * cp * dp} ranks exceed verify.max_ranks={limit}, and tp, "
                          f"cp and ep are never reduced: raise verify.max_ranks to {tp * cp * dp}")
    cfg = copy.deepcopy(job)
    cfg.parallel.pipeline_parallel_size = new_pp
    if new_pp == 1:
        cfg.parallel.virtual_pipeline_size, vpp = None, 1
        cfg.parallel.pipeline_schedule = "1f1b"
    _shrink_model(cfg, tp, new_pp, cp, vpp, reduced)
    _shrink_run(cfg, tp * new_pp * cp * dp, job.verify.steps, run_dir)
    try:
        derived = derive(cfg)
    except ConfigError as e:
        raise ConfigError(f"mode=verify could not shrink model={job.model.name} at this layout: {one_line(e)}") from None
    cfg.data.global_batch_size = derived.global_batch_size  # the same batch in one process and at other layouts
    return Shrunk(cfg, derived, reduced)


def single_process(shrunk: RunConfig, run_dir: str, steps: int) -> RunConfig:
    """The shrunk job in one process: the reference every layout must equal."""
    cfg = copy.deepcopy(shrunk)
    par = cfg.parallel
    par.tensor_parallel_size = par.pipeline_parallel_size = par.context_parallel_size = 1
    par.expert_parallel_size, par.expert_tensor_parallel_size = 1, None
    par.virtual_pipeline_size, par.sequence_parallel, par.pipeline_schedule = None, False, "1f1b"
    par.data_parallel, par.layers_per_stage = "ddp", None
    par.tp_comm_overlap = False
    cfg.optim.distributed_optimizer = False
    cfg.trainer.devices, cfg.trainer.max_steps = 1, steps
    retarget(cfg, run_dir)
    return cfg


def retarget(cfg: RunConfig, run_dir: str) -> None:
    """``cfg`` runs in ``run_dir``, its checkpoints in ``run_dir/checkpoints``."""
    cfg.run_dir, cfg.checkpoint.dir = run_dir, f"{run_dir}/checkpoints"
