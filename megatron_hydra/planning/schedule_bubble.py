"""The pipeline bubble of a schedule, counted from its own action order with unit costs.

Each rank runs its actions (``pipeline_runtime.action_orders``: the order torch's schedule will
run) one after another; an action starts when its rank is free and its inputs exist:
- F (forward) of stage s, micro-batch j: after F of stage s-1, j;
- B (full backward) or I (its input-gradient half) of s, j: after F of s, j (same rank) and B or
  I of s+1, j;
- W (weight gradient) of s, j: after I of s, j.
Communication is free and every stage costs the same: F = 1, B = 2 (I = 1 and W = 1 when the
backward is split), per stage. A rank's idle time is the step's span minus its busy time, and the
bubble is idle / busy, the figure Narayanan et al. (2021) give analytically as (p - 1) / m for
1F1B and (p - 1) / (v m) for the interleaved schedule. Unlike timing the real schedule, this does
not depend on how many cores the ranks share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Bubble:
    span: float  # the step, first start to last end
    busy: Tuple[float, ...]  # per rank
    idle_over_busy: Tuple[float, ...]  # per rank

    @property
    def mean(self) -> float:
        return sum(self.idle_over_busy) / len(self.idle_over_busy)


def simulate(orders: Dict[int, List[Tuple[str, int, int]]], num_stages: int,
             costs: Dict[str, float] = UNIT_COSTS) -> Bubble:
    """Run every rank's actions in order under the dependencies above; fail on a deadlock."""
    done: Dict[Tuple[str, int, int], float] = {}
    free = {rank: 0.0 for rank in orders}
    next_index = {rank: 0 for rank in orders}

    def ready(kind: str, stage: int, mb: int) -> Optional[float]:
        if kind == "F":
            deps = [("F", stage - 1, mb)] if stage > 0 else []
        elif kind in ("B", "I"):
            deps = [("F", stage, mb)] + ([("G", stage + 1, mb)] if stage < num_stages - 1 else [])
        else:
            deps = [("G", stage, mb)]
        times = [done.get(d) for d in deps]
        return None if any(t is None for t in times) else max(times, default=0.0)

    remaining = sum(len(a) for a in orders.values())
    while remaining:
        progressed = False
        for rank, actions in orders.items():
            while next_index[rank] < len(actions):
                kind, stage, mb = actions[next_index[rank]]
                at = ready(kind, stage, mb)
                if at is None:
                    break
                end = max(free[rank], at) + costs[kind]
                done[(kind, stage, mb)] = free[rank] = end
                if kind in ("B", "I"):
                    done[("G", stage, mb)] = end  # the input gradient the previous stage waits for
                next_index[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: a[next_index[r]] for r, a in orders.items() if next_index[r] < len(a)}
            raise RuntimeError(f"the action order deadlocks at {stuck}")
    span = max(free.values())
    busy = tuple(sum(costs[k] for k, _, _ in orders[r]) for r in sorted(orders))
    return Bubble(span, busy, tuple((span - b) / b for b in busy))


def analytic(schedule: str, pp: int, vpp: int, m: int) -> Optional[float]:
    """Narayanan et al. (2021): (p - 1) / m for 1F1B, (p - 1) / (v m) interleaved; None for the
    zero-bubble schedules (their bubble depends on how the cost splits between I and W, and on
    the warm-up, so the count is the figure)."""
    return {"1f1b": (pp - 1) / m, "interleaved_1f1b": (pp - 1) / (vpp * m)}.get(schedule)


def schedule_bubble(schedule: str, pp: int, vpp: int, m: int) -> Bubble:
    """The bubble of torch's ``schedule`` (``parallel.pipeline.SCHEDULES``) at ``pp`` ranks,
    ``vpp`` stages per rank (2 for ZB-V) and ``m`` micro-batches, with unit costs."""
    from megatron_hydra.parallel.pipeline import SCHEDULES, stage_indices
    from megatron_hydra.parallel.pipeline_runtime import action_orders

    num_stages = pp * vpp
    orders = action_orders(SCHEDULES[schedule], lambda r: stage_indices(r, pp, vpp, schedule), pp, num_stages, m)
    return simulate(orders, num_stages)
