"""What a SLURM job tells a task through its environment, and the one thing we ask of SLURM back.

An ``srun`` step (what hydra-submitit-launcher runs, one task per device) gives each task
``SLURM_PROCID`` (global rank), ``SLURM_LOCALID`` (rank on its node), ``SLURM_NODEID`` (its node),
the step's task count and tasks per node, and the job's node list. From those we derive the
variables of torch.distributed's ``env://`` rendezvous: rank 0 runs on the first node of the list,
so that node is the master, and the port follows from the job id, so that every task of the job
computes the same one without talking.

Requeue: when the job is about to hit its time limit SLURM sends the warning signal; the
checkpoint callback saves at the next step boundary and then calls ``requeue`` here (rank 0 only),
so the job comes back and ``checkpoint.resume=auto`` continues it. Nothing else requeues
(see docs/cluster.md, "Who owns the signal").
"""

from __future__ import annotations

import itertools
import logging
import re
import subprocess
from typing import Dict, List, Mapping, Optional

from megatron_hydra.errors import ConfigError

log = logging.getLogger("megatron_hydra")
_requeued: List[str] = []  # job ids this process requeued

_BRACKET = re.compile(r"\[([^\]]*)\]")


def _split_top_level(text: str) -> List[str]:
    """Split at commas that are not inside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_range(spec: str) -> List[str]:
    """``01-03,7`` -> ``01 02 03 7`` (zero padding of a range kept, as SLURM writes it)."""
    out = []
    for item in spec.split(","):
        lo, _, hi = item.partition("-")
        if not hi:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> List[str]:
    """Host names of a SLURM node list, in order: ``node[01-03,7],login1`` ->
    ``node01 node02 node03 node7 login1``; several bracket groups in one name multiply
    (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``)."""
    hosts = []
    for expr in _split_top_level(nodelist):
        pieces = _BRACKET.split(expr)  # literal, range, literal, range, ..., literal
        choices = [[p] if i % 2 == 0 else _expand_range(p) for i, p in enumerate(pieces)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    if not hosts:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} names no host: is this a SLURM job?")
    return hosts


def expand_tasks_per_node(value: str) -> List[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``: ``4(x2),3`` -> ``[4, 4, 3]``."""
    counts = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ConfigError(f"cannot read SLURM tasks per node {value!r}: expected a form like '4(x2),3'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def in_srun_step(env: Mapping[str, str]) -> bool:
    """SLURM_STEP_NUM_TASKS exists only inside an srun step: a batch script that runs python
    directly under --ntasks>1 is not one worker of a launch and must not wait for peers."""
    return "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1


def step_layout(env: Mapping[str, str]) -> Dict[str, int]:
    """Rank, local rank, world size, tasks on this node, node rank and node count of this task."""
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    per_node_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
    per_node = expand_tasks_per_node(per_node_text)
    node = int(env.get("SLURM_NODEID", "0"))
    return {
        "rank": int(env["SLURM_PROCID"]),
        "local_rank": int(env.get("SLURM_LOCALID", "0")),
        "world_size": world,
        "local_world_size": per_node[min(node, len(per_node) - 1)],
        "node_rank": node,
        "num_nodes": int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or len(per_node)),
    }


def master_port(env: Mapping[str, str]) -> str:
    """MASTER_PORT if set, else one in [20000, 40000) from the job id: the same on every task,
    and different for two jobs that share a node (unless their ids differ by a multiple of 20000)."""
    return env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)


def rendezvous_env(env: Mapping[str, str]) -> Dict[str, str]:
    """The variables torch.distributed's env:// init needs, derived from SLURM's."""
    layout = step_layout(env)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    return {
        "RANK": str(layout["rank"]),
        "LOCAL_RANK": str(layout["local_rank"]),
        "WORLD_SIZE": str(layout["world_size"]),
        "MASTER_ADDR": env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
        "MASTER_PORT": master_port(env),
    }


def requeue(env: Mapping[str, str]) -> Optional[str]:
    """Put this job back into the queue (``scontrol requeue``); returns the job id, or None
    outside a SLURM job. SLURM then ends the current run of the job, whose checkpoint is saved."""
    job = env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}" if job else env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60, capture_output=True, text=True)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("checkpoint saved, but requeueing SLURM job %s failed (%s): resubmit it by hand", job_id, exc)
        return None
    log.info("requeued SLURM job %s: it continues from the checkpoint just saved", job_id)
    _requeued.append(job_id)
    return job_id


def requeued() -> bool:
    """Whether this process requeued its job (the run is to continue in the job's next start)."""
    return bool(_requeued)
