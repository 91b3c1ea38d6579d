"""A Megatron-LM command line as launch.py's config: the layout, precision, recompute, batch,
optimizer and schedule, data, logging and checkpoints (the model is ``model_flags``).

Megatron-LM counts its schedule in samples internally, so its iteration counts follow from it:
``--lr-warmup-fraction`` is a fraction of the decay length (``--lr-decay-iters``, itself
``--train-iters`` when absent), and the ``*-samples`` flags are divided by the global batch,
whose default is micro-batch x dp (ours would also multiply by pp, so it is always written out).
"""

from __future__ import annotations

import re
from typing import Optional

from megatron_hydra.errors import ConfigError
from megatron_hydra.migrate.command_line import CommandLine
from megatron_hydra.migrate.data_flags import translate_data
from megatron_hydra.migrate.model_flags import translate_model
from megatron_hydra.migrate.translation import Translation

RECIPES = {"delayed": "delayed", "tensorwise": "current"}
# Megatron-LM asserts these are positive; a translation never divides by one that is not
POSITIVE = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--num-query-groups",
            "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
            "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank", "--micro-batch-size",
            "--global-batch-size", "--expert-model-parallel-size", "--num-experts", "--moe-router-topk")
SCHEDULES = ("cosine", "linear", "constant")


def translate(cl: CommandLine) -> Translation:
    """Our config for ``cl``: every key with the flags it came from, and what has no equivalent."""
    t = Translation(cl)
    t.group("trainer", "gpu")
    for flag, value, why in cl.bad:
        t.refuse(flag, f"{value!r} {why}" if value else why)
    for flag in POSITIVE:
        if cl.given(flag) and cl.values[flag] < 1:
            t.refuse(flag, "must be a positive integer (Megatron-LM asserts it too)")
            del cl.values[flag]
    dp = _layout(t)
    translate_model(t)
    _precision(t)
    _recompute(t)
    gbs = _batch(t, dp)
    _schedule(t, gbs)
    translate_data(t)
    _logging(t)
    _checkpoints(t)
    return t


def _layout(t: Translation) -> Optional[int]:
    """Devices, nodes and the parallel degrees; the data-parallel size they leave (None: unknown)."""
    cl = t.cl
    tp, pp, cp = (cl.get(f) for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                       "--context-parallel-size"))
    model_parallel = tp * pp * cp
    devices, nodes = cl.devices, cl.num_nodes or 1
    counted = cl.counted
    if devices is None:
        devices = model_parallel
        t.notes.append(f"the command line has no launcher: its world size is taken as tp x pp x cp = {model_parallel} "
                       "(dp 1); set trainer.devices and trainer.num_nodes for the real one")
    t.set("trainer.devices", devices, *counted.get("devices", ()))
    t.set("trainer.num_nodes", nodes, *counted.get("nodes", ()))
    if nodes > 1:
        t.notes.append(f"{nodes} nodes: start it on every node as before (torchrun / srun run launch.py as one "
                       "worker per rank; docs/cluster.md)")
    for key, value, flag in (("tensor_parallel_size", tp, "--tensor-model-parallel-size"),
                             ("pipeline_parallel_size", pp, "--pipeline-model-parallel-size"),
                             ("context_parallel_size", cp, "--context-parallel-size")):
        t.set(f"parallel.{key}", value, flag)
    _virtual_stages(t, pp)
    _parallel_options(t, tp, cp)
    if devices == "auto":
        return None
    if (devices * nodes) % model_parallel:
        t.notes.append(f"{devices * nodes} ranks are not divisible by tp x pp x cp = {model_parallel}: Megatron-LM "
                       "refuses this layout too; give the launcher's real node count (trainer.num_nodes)")
        return None
    return devices * nodes // model_parallel


def _virtual_stages(t: Translation, pp: int) -> None:
    cl = t.cl
    layers = cl.get("--num-layers") or 0
    vpp, flag = None, None
    if cl.given("--num-virtual-stages-per-pipeline-rank"):
        vpp, flag = cl.get("--num-virtual-stages-per-pipeline-rank"), "--num-virtual-stages-per-pipeline-rank"
    elif cl.given("--num-layers-per-virtual-pipeline-stage"):
        per_stage, flag = cl.get("--num-layers-per-virtual-pipeline-stage"), "--num-layers-per-virtual-pipeline-stage"
        if layers % pp or (layers // pp) % per_stage:
            t.refuse(flag, f"{layers} layers over {pp} stages do not split into chunks of {per_stage}")
        else:
            vpp = layers // pp // per_stage
    if vpp is not None and vpp > 1:
        t.set("parallel.virtual_pipeline_size", vpp, flag)
        t.set("parallel.pipeline_schedule", "interleaved_1f1b", flag)
    elif flag:
        t.ignore(flag, "one virtual stage per rank: Megatron-LM runs the plain 1F1B schedule then")
    first, last = cl.get("--decoder-first-pipeline-num-layers"), cl.get("--decoder-last-pipeline-num-layers")
    if first is None and last is None:
        return
    flags = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")
    inner = pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    if vpp not in (None, 1) or inner < 0 or (inner == 0 and rest) or (inner and rest % inner) or rest < 0:
        t.refuse(flags[0] if first is not None else flags[1],
                 f"{layers} layers over {pp} stages with these end stages do not split evenly (or with virtual "
                 "stages): give parallel.layers_per_stage")
        return
    middle = [rest // inner] * inner if inner else []
    stages = ([first] if first is not None else []) + middle + ([last] if last is not None else [])
    t.set("parallel.layers_per_stage", stages, *flags)


def _parallel_options(t: Translation, tp: int, cp: int) -> None:
    cl = t.cl
    if cl.get("--sequence-parallel"):
        if tp > 1:
            t.set("parallel.sequence_parallel", True, "--sequence-parallel")
        else:
            t.ignore("--sequence-parallel", "Megatron-LM turns it off at tensor-model-parallel size 1")
    kinds = cl.get("--cp-comm-type")
    if cl.given("--cp-comm-type"):
        if len(kinds) != 1 or kinds[0] not in ("p2p", "a2a"):
            t.refuse("--cp-comm-type", "context parallelism here exchanges by p2p (ring) or a2a (Ulysses), the "
                                       "same for every layer")
        elif cp > 1:
            t.set("parallel.cp_comm_type", kinds[0], "--cp-comm-type")
        else:
            t.ignore("--cp-comm-type", "no context parallelism (--context-parallel-size 1)")
    if cl.given("--expert-model-parallel-size"):
        t.set("parallel.expert_parallel_size", cl.get("--expert-model-parallel-size"), "--expert-model-parallel-size")
    etp = cl.get("--expert-tensor-parallel-size")
    if etp is not None:
        if etp == tp:
            t.ignore("--expert-tensor-parallel-size", "it equals tp: experts split like the dense MLP, the default")
        elif etp == 1:
            t.set("parallel.expert_tensor_parallel_size", 1, "--expert-tensor-parallel-size")
        else:
            t.refuse("--expert-tensor-parallel-size", "experts here are split over tp or kept whole (1)")
    if cl.get("--use-distributed-optimizer"):
        t.set("optim.distributed_optimizer", True, "--use-distributed-optimizer")
    if cl.get("--use-torch-fsdp2"):
        t.set("parallel.data_parallel", "fsdp", "--use-torch-fsdp2")
    if cl.given("--ddp-bucket-size"):
        t.set("parallel.grad_bucket_size", cl.get("--ddp-bucket-size"), "--ddp-bucket-size")
    if cl.given("--distributed-timeout-minutes"):
        t.set("trainer.collective_timeout_s", 60 * cl.get("--distributed-timeout-minutes"),
              "--distributed-timeout-minutes")


def _precision(t: Translation) -> None:
    cl = t.cl
    fp16, bf16, fp8 = cl.get("--fp16"), cl.get("--bf16"), cl.given("--fp8-format")
    if fp16 and bf16:
        t.refuse("--bf16", "--fp16 and --bf16 together: Megatron-LM refuses it too")
    scaling = ("--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis")
    if fp16 and not fp8:
        t.group("precision", "fp16", "--fp16")
        for flag, key, kind in zip(scaling, ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"),
                                   (float, float, int, int)):
            t.set(f"precision.{key}", kind(cl.get(flag)), flag)
    else:
        for flag in scaling:
            t.ignore(flag, "Megatron-LM reads it with --fp16 only")
        t.group("precision", "bf16" if bf16 else "fp32", "--bf16")
    if fp8:
        _fp8(t, fp16)
    else:
        for flag in ("--fp8-recipe", "--fp8-margin", "--fp8-amax-history-len", "--fp8-amax-compute-algo"):
            t.ignore(flag, "Megatron-LM reads it with --fp8-format only")
    for flag in ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"):
        if cl.given(flag):
            if cl.get(flag) == "fp32":
                t.ignore(flag, "fp32, as here")
            else:
                t.refuse(flag, "main weights, gradients and Adam state are fp32 here")


def _fp8(t: Translation, fp16: bool) -> None:
    cl = t.cl
    if fp16:
        t.refuse("--fp8-format", "FP8 here runs over bf16 weights (precision=fp8); use --bf16")
        return
    t.group("precision", "fp8", "--fp8-format")
    t.ignore("--bf16", "FP8 here runs over bf16 weights (precision=fp8)")
    t.set("model.transformer_impl", "transformer_engine", "--fp8-format")
    fmt, recipe = cl.get("--fp8-format"), cl.get("--fp8-recipe")
    if fmt not in ("hybrid", "e4m3"):
        t.refuse("--fp8-format", "use hybrid or e4m3")
    else:
        t.set("precision.fp8.format", fmt, "--fp8-format")
    if recipe not in RECIPES:
        t.refuse("--fp8-recipe", "Transformer Engine's delayed or tensorwise (current) scaling only")
    else:
        t.set("precision.fp8.recipe", RECIPES[recipe], "--fp8-recipe")
    t.set("precision.fp8.margin", cl.get("--fp8-margin"), "--fp8-margin")
    t.set("precision.fp8.amax_history_len", cl.get("--fp8-amax-history-len"), "--fp8-amax-history-len")
    t.set("precision.fp8.amax_compute_algo", cl.get("--fp8-amax-compute-algo"), "--fp8-amax-compute-algo")


def _recompute(t: Translation) -> None:
    cl = t.cl
    granularity = cl.get("--recompute-granularity")
    flag = "--recompute-granularity"
    if cl.get("--recompute-activations"):  # Megatron-LM: it sets selective, whatever the granularity flag says
        granularity, flag = "selective", "--recompute-activations"
        t.ignore("--recompute-granularity", "--recompute-activations sets selective in Megatron-LM")
    if granularity not in (None, "full", "selective"):
        t.refuse(flag, "use full or selective")
        return
    if granularity:
        t.set("recompute.granularity", granularity, flag)
    modules = cl.get("--recompute-modules")
    if modules is not None:
        if modules in (["core_attn"], []):
            t.ignore("--recompute-modules", "selective recompute here recomputes core attention")
        else:
            t.refuse("--recompute-modules", "selective recompute here recomputes core attention only")
    if granularity == "full":
        if cl.given("--recompute-method"):
            t.set("recompute.method", cl.get("--recompute-method"), "--recompute-method")
        else:
            t.notes.append("--recompute-granularity full without --recompute-method: Megatron-LM requires one; "
                           "recompute.method=uniform here")
        if cl.given("--recompute-num-layers"):
            t.set("recompute.num_layers", cl.get("--recompute-num-layers"), "--recompute-num-layers")
    else:
        for f in ("--recompute-method", "--recompute-num-layers"):
            t.ignore(f, "Megatron-LM reads it with --recompute-granularity full only")


def _batch(t: Translation, dp: Optional[int]) -> Optional[int]:
    cl = t.cl
    micro = cl.get("--micro-batch-size")
    if micro is None:
        t.refuse("--micro-batch-size", "Megatron-LM requires it: add it")
        return None
    t.set("data.micro_batch_size", micro, "--micro-batch-size")
    if cl.given("--global-batch-size"):
        gbs = cl.get("--global-batch-size")
    elif dp is None:
        t.notes.append("the data-parallel size is not known: Megatron-LM's global batch (micro-batch x dp) cannot "
                       "be written out; set data.global_batch_size")
        return None
    else:
        gbs = micro * dp
    t.set("data.global_batch_size", gbs, "--global-batch-size")
    return gbs


def _iterations(t: Translation, samples: int, gbs: Optional[int], flag: str, floor: bool = False) -> Optional[int]:
    """Megatron-LM's sample count as optimizer steps of ``gbs`` samples: ``floor`` for the
    training length (Megatron-LM trains train_samples // global batch iterations), else the
    nearest step to a schedule point that falls between steps."""
    if gbs is None:
        t.refuse(flag, "a count of samples needs the global batch, which is not known: give iterations")
        return None
    steps = samples // gbs if floor else round(samples / gbs)
    if steps * gbs != samples and not floor:
        t.notes.append(f"{flag} {samples} is {samples / gbs:.3f} global batches of {gbs}: rounded to {steps} steps")
    return steps


def _schedule(t: Translation, gbs: Optional[int]) -> None:
    cl = t.cl
    if cl.given("--train-samples"):
        steps = _iterations(t, cl.get("--train-samples"), gbs, "--train-samples", floor=True)
        steps_flag = "--train-samples"
    else:
        steps, steps_flag = cl.get("--train-iters"), "--train-iters"
        if steps is None:
            t.notes.append("neither --train-iters nor --train-samples: trainer.max_steps keeps its preset value")
    if steps is not None:
        t.set("trainer.max_steps", steps, steps_flag)
    _optimizer(t)
    style = cl.get("--lr-decay-style")
    if style in SCHEDULES:
        t.set("optim.lr_schedule", style, "--lr-decay-style")
    else:
        t.refuse("--lr-decay-style", f"the {style} schedule is not available here: use cosine, linear or constant")
    if cl.given("--lr-decay-samples"):
        decay = _iterations(t, cl.get("--lr-decay-samples"), gbs, "--lr-decay-samples")
        decay_flag = "--lr-decay-samples"
    else:
        decay, decay_flag = cl.get("--lr-decay-iters"), "--lr-decay-iters"
    if decay is not None and decay != steps:
        t.set("optim.decay_steps", decay, decay_flag)
    elif decay is not None:
        t.ignore(decay_flag, "it equals the training length, the default decay length here")
    _warmup(t, gbs, decay if decay is not None else steps)


def _optimizer(t: Translation) -> None:
    cl = t.cl
    kind = cl.get("--optimizer")
    if kind == "adam":
        t.ignore("--optimizer", "Megatron-LM's adam is AdamW (decoupled weight decay): optim=adamw, as here")
    else:
        t.refuse("--optimizer", "AdamW (Megatron-LM's adam) is the optimizer here")
    if cl.get("--lr") is None:
        t.refuse("--lr", "Megatron-LM needs a learning rate: add it")
    else:
        t.set("optim.lr", cl.get("--lr"), "--lr")
    for flag, key in (("--min-lr", "min_lr"), ("--weight-decay", "weight_decay"), ("--adam-beta1", "adam_beta1"),
                      ("--adam-beta2", "adam_beta2"), ("--adam-eps", "adam_eps"), ("--clip-grad", "clip_grad")):
        t.set(f"optim.{key}", cl.get(flag), flag)
    if cl.get("--weight-decay-incr-style") != "constant":
        t.refuse("--weight-decay-incr-style", "weight decay is constant here")
    t.ignore("--weight-decay-incr-style", "constant, as here")
    for flag in ("--start-weight-decay", "--end-weight-decay"):
        t.ignore(flag, "Megatron-LM reads it with a --weight-decay-incr-style other than constant only")
    if cl.get("--lr-warmup-init"):
        t.refuse("--lr-warmup-init", "warmup starts from 0 here")


def _warmup(t: Translation, gbs: Optional[int], decay: Optional[int]) -> None:
    cl = t.cl
    fraction = cl.get("--lr-warmup-fraction")
    if fraction is not None:
        if decay is None:
            t.refuse("--lr-warmup-fraction", "a fraction of the decay length, which is not known")
            return
        warmup = fraction * decay
        steps = round(warmup)
        if abs(steps - warmup) > 1e-9 * max(1.0, warmup):
            t.notes.append(f"--lr-warmup-fraction {fraction} of {decay} decay steps is {warmup:g} steps: rounded "
                           f"to {steps}")
        t.set("optim.warmup_steps", steps, "--lr-warmup-fraction")
        for flag in ("--lr-warmup-iters", "--lr-warmup-samples"):
            t.ignore(flag, "--lr-warmup-fraction takes precedence in Megatron-LM")
    elif cl.given("--lr-warmup-samples"):
        steps = _iterations(t, cl.get("--lr-warmup-samples"), gbs, "--lr-warmup-samples")
        if steps is not None:
            t.set("optim.warmup_steps", steps, "--lr-warmup-samples")
    else:
        t.set("optim.warmup_steps", cl.get("--lr-warmup-iters"), "--lr-warmup-iters")


def _logging(t: Translation) -> None:
    cl = t.cl
    t.set("trainer.log_every_n_steps", cl.get("--log-interval"), "--log-interval")
    _validation(t)
    if cl.get("--profile"):
        start, end = cl.get("--profile-step-start"), cl.get("--profile-step-end")
        t.set("trainer.profile_steps", [start, end - 1], "--profile", "--profile-step-start", "--profile-step-end")
    else:
        for flag in ("--profile-step-start", "--profile-step-end"):
            t.ignore(flag, "Megatron-LM reads it with --profile only")
    if cl.get("--wandb-project"):
        t.set("trainer.logger", ["tensorboard", "csv", "wandb"], "--wandb-project")
        t.set("trainer.wandb.project", cl.get("--wandb-project"), "--wandb-project")
        for flag, key in (("--wandb-exp-name", "name"), ("--wandb-save-dir", "dir")):
            if cl.get(flag):
                t.set(f"trainer.wandb.{key}", cl.get(flag), flag)
    else:
        for flag in ("--wandb-exp-name", "--wandb-save-dir", "--wandb-project"):
            t.ignore(flag, "Megatron-LM logs to W&B only with a --wandb-project")


def _validation(t: Translation) -> None:
    """Every --eval-interval steps, --eval-iters global batches of the valid split; none when
    either is 0 or the split gives the valid set no share (Megatron-LM builds no valid set then)."""
    cl = t.cl
    flags = ("--eval-interval", "--eval-iters")
    interval, iters = cl.get("--eval-interval"), cl.get("--eval-iters")
    split = t.keys.get("data.split") if t.groups.get("data") == "indexed" else None
    why = None
    if not iters:
        why = "--eval-iters 0: Megatron-LM builds no validation set"
    elif split is not None and _valid_share(split) == 0:
        why = f"{cl.shown('--split')} leaves the valid split empty: Megatron-LM validates nothing"
    if why is None:
        t.set("trainer.val_check_interval", interval, "--eval-interval")
        if interval:
            t.set("trainer.limit_val_batches", iters, "--eval-iters")
        else:
            t.ignore("--eval-iters", "--eval-interval 0: no validation during training")
        return
    for flag in flags:
        t.ignore(flag, why)
    if not any(cl.given(f) for f in flags):
        t.notes.append(f"no validation: {why}")


def _valid_share(split) -> Optional[float]:
    """The valid split's share of ``split`` (None: not a split data.split reads)."""
    from megatron_hydra.data.builders import parse_split

    try:
        return parse_split(split)[1]
    except ConfigError:
        return None


def _checkpoints(t: Translation) -> None:
    cl = t.cl
    save, load = cl.get("--save"), cl.get("--load")
    if save:
        t.set("checkpoint.dir", save, "--save")
        t.set("checkpoint.keep_last", 0, "--save")  # Megatron-LM never deletes a checkpoint
    if cl.given("--save-interval"):
        if save:
            t.set("checkpoint.every_n_steps", cl.get("--save-interval"), "--save-interval")
        else:
            t.ignore("--save-interval", "Megatron-LM saves only with --save")
    if load:
        converted = re.sub(r"/+$", "", load) + "-hydra"
        convert = f"python -m megatron_hydra.convert from_megatron input={load} output={converted}"
        if load == save:
            t.notes.append(f"--load {load} is --save's directory: this run continues its own checkpoints there "
                           f"(checkpoint.resume=auto); to start from a Megatron-LM checkpoint already there, "
                           f"convert it first ({convert}) and add checkpoint.load={converted}")
            t.ignore("--load", "the same directory as --save: checkpoint.resume=auto continues there")
        else:
            t.before.append(convert)
            t.set("checkpoint.load", converted, "--load")
    if cl.get("--no-load-optim") or cl.get("--finetune"):
        flags = ("--no-load-optim", "--finetune")
        t.set("checkpoint.load_optimizer", False, *flags)
    if cl.get("--finetune"):
        t.notes.append("--finetune: the weights load without optimizer state, but the step count continues from "
                       "the checkpoint's here (Megatron-LM restarts at iteration 0)")
    t.ignore("--async-save", "saves are asynchronous here by default (checkpoint.async_save)")

