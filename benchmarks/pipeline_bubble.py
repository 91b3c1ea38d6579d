"""Pipeline bubble: counted from each schedule's action order, and measured, against the analytic.

    python benchmarks/pipeline_bubble.py [pp=4] [steps=3] [hidden=256] [seq=128] [threads=1] [timed=1]

First, the count (``planning.schedule_bubble``): torch's own per-rank action order of each
schedule replayed with unit costs (F 1, B 2; the zero-bubble halves I 1, W 1) and free
communication. It does not depend on the machine, and for 1F1B and interleaved 1F1B it is the
analytic figure below; the zero-bubble schedules (interleaved ZB and ZB-V) are printed beside them.

Then (``timed=0`` skips it) the real schedules run:
For 1F1B (one stage per rank) and interleaved 1F1B (v = 2 stages per rank) with m in {4, 8, 16}
micro-batches, every forward/backward computation of every stage is timestamped
(``Pipeline.events``); a step spans from the first computation on any rank to the last. A rank's
idle time is the span minus its busy time. Narayanan et al. (2021) give the bubble relative to
the ideal (busy) time as (pp - 1) / m for 1F1B and (pp - 1) / (v m) for the interleaved schedule:
that is what ``idle/busy`` compares against; ``idle %`` is the same as a share of the step.

The analytic figure assumes equal stages, free communication and one device per rank. On a
machine with fewer cores than ranks the ranks share cores, so busy times stretch when others
compute and shrink when they idle: read the numbers from a machine with >= pp free cores. Prints,
asserts nothing.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2))
MICROBATCHES = (4, 8, 16)


def _config(pp: int, vpp: int, schedule: str, m: int, hidden: int, seq: int):
    from megatron_hydra.config.schema import RunConfig

    cfg = RunConfig()
    cfg.run_dir = "unused"
    cfg.trainer.devices = pp
    cfg.parallel.pipeline_parallel_size, cfg.parallel.pipeline_schedule = pp, schedule
    cfg.parallel.virtual_pipeline_size = vpp if vpp > 1 else None
    cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads = 2 * pp, hidden, 8
    cfg.model.seq_length, cfg.model.vocab_size = seq, 1000
    cfg.data.micro_batch_size, cfg.data.global_batch_size = 2, 2 * m
    return cfg


def _measure(pp, vpp, schedule, m, steps, hidden, seq):
    """This rank's events of ``steps`` timed steps (after one warm-up step)."""
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.pipeline import Pipeline
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.models.archs import masked_mean
    from megatron_hydra.models.stages import build_stage_chunks

    cfg = _config(pp, vpp, schedule, m, hidden, seq)
    derived = derive(cfg)
    ps = ParallelState.build(pp=pp)
    chunks, stages = build_stage_chunks(cfg, derived, ps)
    pipe = Pipeline(chunks, stages, ps, schedule, m, masked_mean, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (2 * m, seq + 1), generator=gen)
    mask = torch.ones(2 * m, seq)
    per_step = []
    for step in range(steps + 1):
        pipe.events = []
        dist.barrier()
        pipe.train_step(tokens[:, :-1], tokens[:, 1:], mask)
        for c in chunks:
            c.zero_grad(set_to_none=False)
        if step:
            per_step.append([(start, end) for _, _, _, start, end in pipe.events])
    return per_step


def _rank(rank, world, port, args, out):
    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for schedule, vpp in SCHEDULES:
            for m in MICROBATCHES:
                results[(schedule, m)] = _measure(world, vpp, schedule, m, args["steps"], args["hidden"], args["seq"])
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            out.put(gathered)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo ranks that used point-to-point ops can abort in interpreter teardown


def _report(gathered, pp):
    print(f"{'schedule':<22}{'m':>4}{'analytic':>10}{'idle/busy (per stage)':>34}{'mean':>8}{'idle % of step':>18}")
    for schedule, vpp in SCHEDULES:
        for m in MICROBATCHES:
            per_rank = [g[(schedule, m)] for g in gathered]  # [rank][step] -> [(start, end)]
            ratios, shares = defaultdict(list), defaultdict(list)
            for step in range(len(per_rank[0])):
                spans = [e for r in per_rank for e in r[step]]
                span = max(end for _, end in spans) - min(start for start, _ in spans)
                for rank, r in enumerate(per_rank):
                    busy = sum(end - start for start, end in r[step])
                    ratios[rank].append((span - busy) / busy)
                    shares[rank].append((span - busy) / span)
            ratio = [statistics.median(ratios[r]) for r in range(pp)]
            share = statistics.mean(statistics.median(shares[r]) for r in range(pp))
            analytic = (pp - 1) / (vpp * m)
            print(f"{schedule + (f' v={vpp}' if vpp > 1 else ''):<22}{m:>4}{analytic:>10.3f}"
                  f"{' '.join(f'{x:6.3f}' for x in ratio):>34}{statistics.mean(ratio):>8.3f}{100 * share:>17.1f}%")


def _counted(pp: int) -> None:
    from megatron_hydra.planning.schedule_bubble import analytic, schedule_bubble

    print(f"counted from the schedules' action orders, unit costs, pp={pp}: idle / busy (mean over ranks)")
    print(f"{'schedule':<22}{'m':>4}{'analytic':>10}{'counted':>10}")
    for schedule, vpp in (*SCHEDULES, ("zero_bubble", 2), ("zbv", 2)):
        for m in MICROBATCHES:
            if m < pp:
                continue
            expected = analytic(schedule, pp, vpp, m)
            counted = schedule_bubble(schedule, pp, vpp, m).mean
            print(f"{schedule + (f' v={vpp}' if vpp > 1 else ''):<22}{m:>4}"
                  f"{'-' if expected is None else f'{expected:.4f}':>10}{counted:>10.4f}")
    print()


def main(argv):
    args = {"pp": 4, "steps": 3, "hidden": 256, "seq": 128, "threads": 1, "timed": 1}
    args.update({k: int(v) for k, v in (a.split("=", 1) for a in argv)})
    _counted(args["pp"])
    if not args["timed"]:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(_rank, args=(args["pp"], port, args, out), nprocs=args["pp"], join=False,
                             start_method="spawn")
    gathered = None
    while not ctx.join(timeout=0.1):
        if gathered is None and not out.empty():
            gathered = out.get()
    gathered = gathered if gathered is not None else out.get()
    print(f"pp={args['pp']} layers={2 * args['pp']} hidden={args['hidden']} seq={args['seq']} micro-batch=2 "
          f"threads/rank={args['threads']} cores={os.cpu_count()} timed steps={args['steps']} (median per stage)")
    _report(gathered, args["pp"])


if __name__ == "__main__":
    main(sys.argv[1:])
