"""The launcher's memory check: a run whose plan exceeds a device stops before any worker starts,
with one line that names the shortfall and the cheapest single changes that would make it fit.

What is checked is the plan's ``needed_bytes``: the planned tensors plus headroom (the
cross-entropy transient; on GPUs also the CUDA context, NCCL's buffers and allocator
fragmentation; ``planning.memory``), so a run that fits only without headroom is refused too.

"Cheapest" is an order of cost, not a measurement: selective recompute (recomputes only core
attention, a few percent of the FLOPs), the distributed optimizer (same communication volume as
the all-reduce), sequence parallelism (no extra communication), full recompute (one more forward,
about a third more compute), a smaller micro-batch (less arithmetic intensity), then more tensor or
pipeline parallelism (more communication, fewer data-parallel replicas), and for long sequences
(``planning.context_parallel.LONG_SEQUENCE`` tokens or more) twice the context parallelism (each
rank holds half as many tokens). Each candidate is derived and planned like the run itself; those
that fit are named, else the largest savings.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterator, List, Tuple

from megatron_hydra.config.derive import Derived, derive
from megatron_hydra.config.schema import RunConfig
from megatron_hydra.errors import ConfigError
from megatron_hydra.planning.context_parallel import LONG_SEQUENCE
from megatron_hydra.planning.memory import GIB, MemoryPlan, plan_memory


def _set(key: str, value) -> Callable[[RunConfig], None]:
    group, name = key.split(".")
    return lambda cfg: setattr(getattr(cfg, group), name, value)


def _candidates(cfg: RunConfig, derived: Derived) -> Iterator[Tuple[str, Callable[[RunConfig], None]]]:
    if cfg.recompute.granularity is None:
        yield "recompute.granularity=selective", _set("recompute.granularity", "selective")
    if derived.dp > 1 and not cfg.optim.distributed_optimizer:
        yield "optim.distributed_optimizer=true", _set("optim.distributed_optimizer", True)
    if derived.tp > 1 and not cfg.parallel.sequence_parallel:
        yield "parallel.sequence_parallel=true", _set("parallel.sequence_parallel", True)
    if cfg.recompute.granularity != "full":
        def full(c: RunConfig) -> None:
            c.recompute.granularity, c.recompute.method, c.recompute.num_layers = "full", "uniform", 1
        yield "recompute.granularity=full", full
    if cfg.data.micro_batch_size > 1:
        smaller = cfg.data.micro_batch_size // 2
        yield f"data.micro_batch_size={smaller}", _set("data.micro_batch_size", smaller)
    yield f"parallel.tensor_parallel_size={2 * derived.tp}", _set("parallel.tensor_parallel_size", 2 * derived.tp)
    yield f"parallel.pipeline_parallel_size={2 * derived.pp}", _set("parallel.pipeline_parallel_size", 2 * derived.pp)
    if cfg.model.seq_length >= LONG_SEQUENCE:
        yield f"parallel.context_parallel_size={2 * derived.cp}", _set("parallel.context_parallel_size", 2 * derived.cp)


def _try(cfg: RunConfig, change: Callable[[RunConfig], None]):
    changed = copy.deepcopy(cfg)
    change(changed)
    try:
        return plan_memory(changed, derive(changed), compare=False)
    except ConfigError:  # the change is not a valid layout for this model or world size
        return None


def fixes(cfg: RunConfig, derived: Derived, plan: MemoryPlan) -> List[str]:
    """Single changes that make the plan fit, cheapest first; else the three largest savings
    (those worth at least 5% of the shortfall)."""
    fitting, savings = [], []
    for name, change in _candidates(cfg, derived):
        other = _try(cfg, change)
        if other is None:
            continue
        if other.fits:
            fitting.append(f"{name} (needs {other.peak.needed_bytes / GIB:.2f} GiB)")
        else:
            savings.append((plan.peak.needed_bytes - other.peak.needed_bytes, name))
    if fitting:
        return fitting[:3]
    shortfall = plan.peak.needed_bytes - plan.device_bytes
    best = [(saved, name) for saved, name in sorted(savings, reverse=True) if saved >= 0.05 * shortfall][:3]
    return [f"{name} (saves {saved / GIB:.2f} GiB, not enough alone)" for saved, name in best]


def check_fits(cfg: RunConfig, derived: Derived) -> None:
    """Raise a one-line ConfigError when the run's memory plan exceeds a device."""
    plan = plan_memory(cfg, derived)
    if plan.fits:
        return
    peak = plan.peak
    suggestions = fixes(cfg, derived, plan) or ["a larger trainer.devices x trainer.num_nodes or a smaller model"]
    headroom = (f" ({peak.total_bytes / GIB:.2f} planned + {peak.headroom_bytes / GIB:.2f} headroom)"
                if peak.headroom_bytes else "")
    raise ConfigError(
        f"the memory plan needs {peak.needed_bytes / GIB:.2f} GiB{headroom} on {peak.position} but a device has "
        f"{plan.device_bytes / GIB:.2f} GiB ({plan.device_source}), short by "
        f"{(peak.needed_bytes - plan.device_bytes) / GIB:.2f} GiB: try {'; or '.join(suggestions)} "
        "(mode=plan prints the table; trainer.device_memory_gb overrides the device size)"
    )
