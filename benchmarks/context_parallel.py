"""Context-parallel attention: bytes a rank moves, and how much of the ring exchange compute hides.

    python benchmarks/context_parallel.py

(a) Communication volume. cp gloo ranks run one attention forward + backward under
``collectives.count_comm()`` (counted: the size of what each rank hands to the collective), against
the analytic volume per rank, with e bytes per element, b*s/cp local tokens, d the head size:
    p2p (ring)   forward  (cp-1) K/V blocks             = (cp-1)   * 2 b (s/cp) g d e
                 backward (cp-1) K/V + cp dK/dV blocks  = (2cp-1)  * 2 b (s/cp) g d e
    a2a (Ulysses) forward q, k, v, out; backward dout, dq, dk, dv: each pass (2 h + 2 g') b (s/cp) d e,
                 g' = g, or lcm(g, cp) when cp does not divide the kv heads (they are repeated first).
An all-to-all keeps 1/cp of its input at home, so it sends (cp-1)/cp of the counted bytes to other
ranks; the ring sends all of them. The ring's volume grows with cp, Ulysses' does not.

(b) Overlap of the ring exchange with compute, on CPU. Every ring step issues its exchange,
computes its block, then waits (``record_ring_timeline`` times compute and wait; a step's
exchange is issued just before its compute starts, the backward's final hop of dK/dV just before
its wait). The same sequence of exchanges is also timed alone, without compute. A wait holds two
things: time a neighbour needed to reach the same step (skew: noise, or ranks sharing cores) and
transfer time compute did not hide. The exposed transfer of a wait is what remains after both
ring neighbours had issued the step (timestamps share the host's monotonic clock): hidden =
1 - exposed transfer / exchange alone, per direction; the final hop has no compute to hide behind
and counts as exposed. ``raw`` uses the whole wait instead. Ranks run one thread each; with more
ranks than free cores the numbers are noisy: read cp4 from a machine with >= 4 free cores.

(c) Activations of the whole model per rank at cp 1, 2, 4: one step of rank 0 of a llama3_8b job
(one sequence of 32768 tokens, tp8 with sequence parallelism, bf16) in the dry run (fake process
group, fake GPU; ``training.dry_run``), activations = the step's peak - the state after it,
beside the plan's activations and its CP buffers (``planning.context_parallel``). Target: 1/cp.
Prints, asserts nothing.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CPS = (2, 4)


def _rank(rank, world, port, fn, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        gathered = [None] * world
        dist.all_gather_object(gathered, fn(rank, world, *args))
        if rank == 0:
            out.put(gathered)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo ranks that used point-to-point ops can abort in interpreter teardown


def _spawn(world: int, fn, *args) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks (one thread each): every rank's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(_rank, args=(world, port, fn, args, out), nprocs=world, join=False, start_method="spawn")
    gathered = None
    while not ctx.join(timeout=0.1):
        if gathered is None and not out.empty():
            gathered = out.get()
    return gathered if gathered is not None else out.get()


def _inputs(batch, heads, groups, seq_local, d, dtype):
    gen = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randn(batch, n, seq_local, d, generator=gen).to(dtype).requires_grad_()
            for n in (heads, groups, groups)], torch.randn(batch, heads, seq_local, d, generator=gen).to(dtype)


# ---- (a) communication volume ------------------------------------------------------------------

VOLUME_SHAPE = dict(batch=1, heads=8, groups=2, seq=1024, d=64, dtype=torch.bfloat16)


def _volume(rank, world):
    from megatron_hydra.parallel.collectives import count_comm
    from megatron_hydra.parallel.context_parallel import context_parallel_attention

    shape = VOLUME_SHAPE
    measured = {}
    for comm in ("p2p", "a2a"):
        (q, k, v), dout = _inputs(shape["batch"], shape["heads"], shape["groups"], shape["seq"] // world,
                                  shape["d"], shape["dtype"])
        with count_comm() as forward:
            out = context_parallel_attention(q, k, v, dist.group.WORLD, comm, causal=True)
        with count_comm() as backward:
            out.backward(dout)
        measured[comm] = (sum(forward.bytes.values()), sum(backward.bytes.values()))
    return measured


def analytic_volume(comm: str, cp: int, batch, heads, groups, seq, d, dtype) -> tuple:
    """(forward, backward) bytes a rank hands to the cp collectives (module docstring)."""
    one_head = batch * (seq // cp) * d * torch.empty((), dtype=dtype).element_size()
    if comm == "p2p":
        return (cp - 1) * 2 * groups * one_head, (2 * cp - 1) * 2 * groups * one_head
    kv_heads = groups if groups % cp == 0 else math.lcm(groups, cp)
    return (2 * heads + 2 * kv_heads) * one_head, (2 * heads + 2 * kv_heads) * one_head


def communication_volume() -> None:
    s = VOLUME_SHAPE
    print(f"(a) bytes per rank, one causal attention forward+backward: b={s['batch']} s={s['seq']} heads={s['heads']} "
          f"groups={s['groups']} d={s['d']} {str(s['dtype']).replace('torch.', '')}")
    print(f"  {'cp':>3} {'comm':<5}{'pass':<10}{'measured':>12}{'analytic':>12}{'ratio':>8}{'to other ranks':>16}")
    for cp in CPS:
        per_rank = _spawn(cp, _volume)
        for comm in ("p2p", "a2a"):
            analytic = analytic_volume(comm, cp, **s)
            for i, name in enumerate(("forward", "backward")):
                measured = statistics.mean(r[comm][i] for r in per_rank)
                sent = measured * ((cp - 1) / cp if comm == "a2a" else 1)
                print(f"  {cp:>3} {comm:<5}{name:<10}{measured:>12,.0f}{analytic[i]:>12,}{measured / analytic[i]:>8.4f}"
                      f"{sent:>16,.0f}")


# ---- (b) overlap of the ring exchange ----------------------------------------------------------

OVERLAP_SEQS = (1024, 2048, 4096)
OVERLAP_SHAPE = dict(batch=1, heads=8, groups=8, d=64, dtype=torch.float32)
REPEATS = 3


def _exchanges_alone(kv, cp) -> tuple:
    """Seconds for the forward's and the backward's sequence of ring exchanges without compute."""
    from megatron_hydra.parallel.collectives import ring_exchange

    def timed(steps):
        dist.barrier()
        start = time.perf_counter()
        for sends in steps:
            for work in ring_exchange(sends, [torch.empty_like(t) for t in sends], dist.group.WORLD):
                work.wait()
        return time.perf_counter() - start

    forward = [[kv]] * (cp - 1)
    backward = [[kv]] + [[kv, kv]] * (cp - 2) + [[kv]] * 2  # K/V; K/V + dK/dV; dK/dV; dK/dV home
    return timed(forward), timed(backward)


def _overlap(rank, world):
    """Per sequence length, per timed repeat: this rank's ring timeline and the exchanges alone."""
    from megatron_hydra.parallel.context_parallel import context_parallel_attention, record_ring_timeline

    s = OVERLAP_SHAPE
    results = {}
    for seq in OVERLAP_SEQS:
        (q, k, v), dout = _inputs(s["batch"], s["heads"], s["groups"], seq // world, s["d"], s["dtype"])
        results[seq] = []
        for repeat in range(REPEATS + 1):  # the first is a warm-up
            dist.barrier()
            with record_ring_timeline() as timeline:
                context_parallel_attention(q, k, v, dist.group.WORLD, "p2p", causal=True).backward(dout)
            alone = _exchanges_alone(torch.stack([k.detach(), v.detach()]), world)
            if repeat:
                results[seq].append((list(timeline), dict(zip(("forward", "backward"), alone))))
    return results


def _pass_times(timelines, rank: int, direction: str) -> dict:
    """Seconds of compute, wait and exposed transfer of one pass on ``rank`` (module docstring)."""
    cp = len(timelines)

    def events(r, phase):
        return {e.step: e for e in timelines[r] if e.direction == direction and e.phase == phase}

    def issued(r, step):
        compute = events(r, "compute").get(step)
        return compute.start if compute is not None else events(r, "wait")[step].start

    compute, waits = events(rank, "compute"), events(rank, "wait")
    exposed = sum(max(0.0, w.end - max(w.start, issued((rank - 1) % cp, step), issued((rank + 1) % cp, step)))
                  for step, w in waits.items())
    return {"compute": sum(e.end - e.start for e in compute.values()),
            "wait": sum(e.end - e.start for e in waits.values()), "exposed": exposed}


def ring_overlap() -> None:
    s = OVERLAP_SHAPE
    print(f"\n(b) ring exchange hidden behind compute (CPU, 1 thread per rank, {os.cpu_count()} cores): causal, "
          f"b={s['batch']} heads={s['heads']} groups={s['groups']} d={s['d']} {str(s['dtype']).replace('torch.', '')}; "
          f"ms per pass, median of {REPEATS} over repeats, mean over ranks")
    print(f"  {'cp':>3}{'seq':>6} {'pass':<10}{'compute':>9}{'exch. alone':>12}{'wait':>8}{'exposed':>9}"
          f"{'hidden':>8}{'raw':>8}")
    for cp in CPS:
        per_rank = _spawn(cp, _overlap)
        for seq in OVERLAP_SEQS:
            for direction in ("forward", "backward"):
                rows = []
                for rank in range(cp):
                    per_repeat = [{**_pass_times([r[seq][i][0] for r in per_rank], rank, direction),
                                   "alone": per_rank[rank][seq][i][1][direction]} for i in range(REPEATS)]
                    rows.append({key: statistics.median(p[key] for p in per_repeat) for key in per_repeat[0]})
                ms = {key: 1e3 * statistics.mean(row[key] for row in rows) for key in rows[0]}
                print(f"  {cp:>3}{seq:>6} {direction:<10}{ms['compute']:>9.1f}{ms['alone']:>12.2f}{ms['wait']:>8.2f}"
                      f"{ms['exposed']:>9.2f}{100 * (1 - ms['exposed'] / ms['alone']):>7.1f}%"
                      f"{100 * (1 - ms['wait'] / ms['alone']):>7.1f}%")


# (c) Activations of the whole model per rank ---------------------------------------------------------
MEMORY_JOB = ["model=llama3_8b", "model.seq_length=32768", "parallel=tp8", "parallel.sequence_parallel=true",
              "trainer=gpu", "trainer.devices=8", "data=synthetic", "precision=bf16",
              "optim.distributed_optimizer=true", "data.micro_batch_size=1", "data.global_batch_size=1"]


def activation_memory() -> None:
    """One step of rank 0 of the job at cp 1, 2, 4 in the dry run (fake process group, fake GPU,
    the GPU kernels' shapes): activations = the step's peak - the state after it."""
    from megatron_hydra.config import derive
    from megatron_hydra.config.bundled import compose
    from megatron_hydra.planning.context_parallel import rank_buffer_bytes
    from megatron_hydra.training.dry_run import dry_run

    print("\n(c) activations per rank, llama3_8b, one sequence of 32768 tokens, tp8 + sp, bf16, "
          "dry run of rank 0 (GiB)")
    print(f"{'cp':>4} {'measured':>10} {'x cp1':>8} {'1/cp':>8} {'plan act.':>10} {'cp bufs':>10}")
    base = None
    for cp in (1, 2, 4):
        cfg = compose(MEMORY_JOB + [f"parallel.context_parallel_size={cp}", f"trainer.num_nodes={cp}"])
        derived = derive(cfg)
        (result,) = dry_run(cfg, derived, [0])
        measured = (result.peak_bytes - result.static_bytes) / 2**30
        base = base or measured
        buffers = rank_buffer_bytes(cfg, derived) / 2**30
        print(f"{cp:>4} {measured:>10.2f} {measured / base:>8.3f} {1 / cp:>8.3f} "
              f"{result.plan_activation_bytes / 2**30:>10.2f} {buffers:>10.3f}")


def main() -> None:
    communication_volume()
    ring_overlap()
    activation_memory()


if __name__ == "__main__":
    main()
