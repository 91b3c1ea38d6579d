"""How much communication hides behind compute: each overlap switch off (before) and on (after).

    python benchmarks/overlap.py [dp] [gather] [pp] [tp]      (no argument: all four)

Gloo ranks (one thread each) train a small GPT for a warm-up step and ``STEPS`` timed steps,
built as ``launch.py`` builds them (``LMModule``, ``MegatronStrategy``, the optimizer, ``TrainStep``)
from the config switches alone, so that each row measures what a user's run does:

- ``dp``: the gradient reduce (``dp_all_reduce``, or ``dp_reduce_scatter`` with the distributed
  optimizer) at pp2 x dp2 under ``1f1b`` and ``interleaved_1f1b`` (v = 2), m = 4 and 8 micro-batches
  per step, ``parallel.overlap_grad_reduce`` false / true;
- ``gather``: the distributed optimizer's parameter all-gather (``dp_all_gather``) at dp4,
  ``parallel.overlap_param_gather`` false / true (a step's gathers are waited in the next step's
  forward, so they count once the next step has waited for them);
- ``pp``: the pipeline's sends and receives (torch's schedules call ``torch.distributed`` directly,
  not ``collectives``: this benchmark's ranks alone wrap ``isend`` and ``irecv`` to time them), at
  pp2 x dp2 with every overlap on; torch's schedules have no switch for it;
- ``tp``: the sequence-parallel exchanges at tp2 with sequence parallelism (``all_gather`` /
  ``reduce_scatter``; the ring's ``tp_p2p`` steps with ``parallel.tp_comm_overlap=true``).

Method (``benchmarks/context_parallel.py``'s, extended). ``collectives.record_comm`` gives, per rank,
each collective's issue time and the start and end of its wait on the host's monotonic clock,
shared by the ranks of one machine. The ranks' records are gathered after the run and matched by
kind and per-kind index within each group (every member issues a group's collectives in the same
order). A wait holds two things: time a peer needed to reach the same collective (skew, load
imbalance, ranks sharing cores) and transfer that compute did not hide. The *exposed* part of a wait
is what remains of it after every peer in the group had issued the collective (a blocking
collective waits from its own issue). The same sequence of collectives (same kinds, sizes and
groups) is then timed alone in the same ranks, with no compute, issued back to back and then
waited (the median of 3 repeats): ``hidden = 1 - exposed / alone``, each summed over the timed
steps, the mean over ranks. A receive of the
pipeline is matched with its peer's send: exposed = the part of its wait after the send was posted.
``step ms`` is the wall time of one step (rank mean).

What stays exposed under a pipeline, by construction: on the first stage the tied embedding's bucket
(it waits for the cross-stage sum after the schedule) and the bucket of the first layers, final only
when the backward ends, with nothing left to hide behind (Megatron's buckets behave alike). With
four layers per stage they are a large share of the bytes; with a model's dozens, a small one.

Target: >= 80% hidden for the DP reduce and for the parameter gather at m >= 4 with the switch on;
off, nothing hides (the collectives start after the compute): a row near 0% (or below: the alone
timing is a little faster than a busy machine's) before and high after is the overlap working.
Reading noisy numbers: with more ranks than free cores the ranks take turns on the cores, so a
transfer "hidden" behind compute may really be waiting for a core, and the step times stretch;
repeat a row and compare the change between before and after rather than a single share, and read
the 4-rank rows from a machine with >= 4 free cores. Prints a table, asserts nothing.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from context_parallel import _spawn  # this directory's gloo rank runner (one thread per rank)

STEPS = 3
BASE = ["data=synthetic", "model.num_layers=8", "model.hidden_size=128", "model.num_attention_heads=4",
        "model.seq_length=64", "model.vocab_size=1000", "data.micro_batch_size=2", "optim.warmup_steps=1",
        "optim.clip_grad=0", "parallel.grad_bucket_size=100000", "trainer.enable_progress_bar=false"]
DP_KINDS = ("dp_all_reduce", "dp_reduce_scatter")
TP_KINDS = ("all_gather", "reduce_scatter", "tp_p2p")


def _dp_cases():
    for schedule in ("1f1b", "interleaved_1f1b"):
        layout = ["parallel.pipeline_parallel_size=2", f"parallel.pipeline_schedule={schedule}"]
        layout += ["parallel.virtual_pipeline_size=2"] if schedule != "1f1b" else []
        for m in (4, 8):
            for dist_opt in (False, True):
                for on in (False, True):
                    name = f"{schedule} m={m}{' dist-opt' if dist_opt else ''}"
                    yield ("dp", name, on, [*layout, f"data.global_batch_size={2 * 2 * m}",
                                            f"optim.distributed_optimizer={str(dist_opt).lower()}",
                                            f"parallel.overlap_grad_reduce={str(on).lower()}"])


def _gather_cases():
    for m in (4, 8):
        for on in (False, True):
            yield ("gather", f"dp4 m={m} dist-opt", on, [f"data.global_batch_size={2 * 4 * m}",
                                                      "optim.distributed_optimizer=true",
                                                      f"parallel.overlap_param_gather={str(on).lower()}"])


def _pp_cases():
    for schedule in ("1f1b", "interleaved_1f1b"):
        vpp = ["parallel.virtual_pipeline_size=2"] if schedule != "1f1b" else []
        yield ("pp", f"{schedule} m=8", True, ["parallel.pipeline_parallel_size=2",
                                               f"parallel.pipeline_schedule={schedule}", *vpp,
                                               "data.global_batch_size=32"])


def _tp_cases():
    for on in (False, True):
        yield ("tp", "tp2 sp m=4", on, ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true",
                                        "data.global_batch_size=8", f"parallel.tp_comm_overlap={str(on).lower()}"])


SUITES = {"dp": (4, _dp_cases), "gather": (4, _gather_cases), "pp": (4, _pp_cases), "tp": (2, _tp_cases)}


# ---- in the ranks --------------------------------------------------------------------------------

class _P2P:
    """``torch.distributed.isend`` and ``irecv`` wrapped in this process (torch's schedules call them
    directly, or through ``batch_isend_irecv``, which calls them): each transfer's peer, bytes, post
    time and wait start and end."""

    def __init__(self):
        self.ops = []  # dicts: send (bool), peer, nbytes, issued, wait_start, wait_end

    @contextlib.contextmanager
    def installed(self):
        c10d = sys.modules["torch.distributed.distributed_c10d"]  # P2POp checks its op against these
        originals = {name: getattr(dist, name) for name in ("isend", "irecv")}

        def timed(name):
            def post(tensor, *args, **kwargs):
                work = originals[name](tensor, *args, **kwargs)
                row = dict(send=name == "isend", peer=_peer(args, kwargs), issued=time.perf_counter(),
                           nbytes=tensor.numel() * tensor.element_size(), wait_start=None, wait_end=None)
                self.ops.append(row)
                return _TimedWork(work, row) if work is not None else work
            return post

        wrapped = {name: timed(name) for name in originals}
        for module in (dist, c10d):
            for name, fn in wrapped.items():
                setattr(module, name, fn)
        try:
            yield self
        finally:
            for module in (dist, c10d):
                for name, fn in originals.items():
                    setattr(module, name, fn)


def _peer(args, kwargs) -> int:
    """The global rank at the other end of an ``isend(tensor, dst, group, tag, group_dst=...)`` /
    ``irecv(tensor, src, ...)``."""
    peer = args[0] if args else kwargs.get("dst", kwargs.get("src"))
    if peer is None:
        group = args[1] if len(args) > 1 else kwargs.get("group")
        peer = dist.get_global_rank(group, kwargs.get("group_dst", kwargs.get("group_src")))
    return peer


class _TimedWork:
    def __init__(self, work, row):
        self.work, self.row = work, row

    def wait(self, *args, **kwargs):
        self.row["wait_start"] = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.row["wait_end"] = time.perf_counter()

    def __getattr__(self, name):
        return getattr(self.work, name)


def _strategy(cfg, ps):
    """The strategy as training builds it (``training.train``), its overlap switch from the config."""
    from megatron_hydra.training.strategy import MegatronStrategy

    return MegatronStrategy(ps, torch.device("cpu"), grad_bucket_size=cfg.parallel.grad_bucket_size,
                            distributed_optimizer=cfg.optim.distributed_optimizer,
                            data_parallel=cfg.parallel.data_parallel,
                            overlap_grad_reduce=cfg.parallel.overlap_grad_reduce)


def _batch(samples: int, seq: int) -> dict:
    data = torch.randint(0, 1000, (samples, seq + 1), generator=torch.Generator().manual_seed(0))
    return {"tokens": data[:, :-1], "labels": data[:, 1:], "loss_mask": torch.ones(samples, seq)}


def _alone(events, group) -> float:
    """Seconds of the collectives of ``events`` issued again on ``group`` with no compute: all of
    them back to back, as a step with every bucket ready at once would issue them, then every wait;
    the median of 3 repeats."""
    from megatron_hydra.parallel import collectives as C

    size, repeats = C.group_size(group), []
    for _ in range(3):
        dist.barrier(group=group)
        start, works = time.perf_counter(), []
        for e in events:
            x = torch.zeros(max(size, e.nbytes // 4 // size * size))
            if e.kind in ("dp_all_reduce", "all_reduce"):
                works.append(dist.all_reduce(x, group=group, async_op=True))
            elif e.kind in ("dp_reduce_scatter", "reduce_scatter"):
                works.append(C.reduce_scatter_into(torch.empty(x.numel() // size), x, group))
            elif e.kind == "dp_all_gather":  # recorded with its output's size
                works.append(C.all_gather_into(x, x[:x.numel() // size].clone(), group))
            elif e.kind == "all_gather":  # recorded with its input's size
                works.append(C.all_gather_into(torch.empty(x.numel() * size), x, group))
            else:  # a ring step
                works += C.ring_exchange([x], [torch.empty_like(x)], group, e.kind)
        for w in works:
            w.wait()
        repeats.append(time.perf_counter() - start)
    return statistics.median(repeats)


def _p2p_alone(ops) -> dict:
    """Median seconds of each (source, destination, bytes) transfer the ranks made, sent again
    alone; every rank walks the same list, the pair's two ranks take part."""
    pairs = [None] * dist.get_world_size()
    dist.all_gather_object(pairs, {(dist.get_rank(), o["peer"], o["nbytes"]) for o in ops if o["send"]})
    me, out = dist.get_rank(), {}
    for src, dst, nbytes in sorted(set().union(*pairs)):
        x, times = torch.zeros(max(1, nbytes // 4)), []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            if me == src:
                dist.isend(x, dst).wait()
            elif me == dst:
                dist.irecv(x, src).wait()
                times.append(time.perf_counter() - start)
        if me == dst:
            out[(src, nbytes)] = statistics.median(times)
    return out


def _case(cfg, ps, suite):
    """This rank's recorded steps of one case, and the same collectives timed alone."""
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.collectives import record_comm
    from megatron_hydra.parallel.random import seed_model_parallel, stage_seed
    from megatron_hydra.training.module import LMModule
    from megatron_hydra.training.step import TrainStep

    d = derive(cfg)
    seed = stage_seed(cfg.seed, ps.pp_rank)
    torch.manual_seed(seed)
    seed_model_parallel(seed, ps.tp_rank)
    module = LMModule(cfg, d, ps)
    strategy = _strategy(cfg, ps)
    strategy.connect(module)
    strategy.wrap_model(module)
    optimizer = module.build_optimizer(strategy.grad_buffer)
    step = TrainStep(module, optimizer)
    batch = _batch(d.global_batch_size // d.dp, cfg.model.seq_length)
    step(batch, 0)
    dist.barrier()
    steps, p2p = [], _P2P()
    with p2p.installed() if suite == "pp" else contextlib.nullcontext():
        with record_comm() as recorder:
            for i in range(STEPS + 1):  # the last step only waits for the previous one's parameter gathers
                start = time.perf_counter()
                step(batch, i + 1)
                steps.append((start, time.perf_counter()))
    if hasattr(optimizer, "close"):
        optimizer.close()
    group = ps.tp_group if suite == "tp" else ps.dp_cp_group
    kinds = {"dp": DP_KINDS, "gather": ("dp_all_gather",), "tp": TP_KINDS, "pp": ()}[suite]
    end = steps[STEPS - 1][1]  # what the timed steps issued (waited for by the next step at the latest)
    events = [e for e in recorder.events if e.kind in kinds and e.issued < end and e.wait_end is not None]
    ops = [o for o in p2p.ops if o["issued"] < end]
    return {"events": events, "alone": _alone(events, group), "steps": steps, "p2p": ops,
            "p2p_alone": _p2p_alone(ops) if suite == "pp" else {}, "group": dist.get_process_group_ranks(group)}


def _run_suite(rank, world, suite):
    from megatron_hydra.config import derive
    from megatron_hydra.config.bundled import compose
    from megatron_hydra.parallel.state import ParallelState

    states, results = {}, []
    for _, name, on, overrides in SUITES[suite][1]():
        cfg = compose([*BASE, f"trainer.devices={world}", *overrides])
        d = derive(cfg)
        key = (d.tp, d.pp, d.dp)
        if key not in states:
            states[key] = ParallelState.build(tp=d.tp, pp=d.pp, dp=d.dp)
        results.append(_case(cfg, states[key], suite))
    return results


# ---- after the run: exposed time -----------------------------------------------------------------

def _exposed_collectives(per_rank, rank: int) -> tuple:
    """(exposed, alone) seconds of ``rank``'s recorded collectives of the timed steps (module docstring)."""
    mine = per_rank[rank]
    issued = defaultdict(dict)  # (peer, kind) -> [issue times]
    for peer in mine["group"]:
        counts = defaultdict(int)
        for e in per_rank[peer]["events"]:
            issued[(peer, e.kind)][counts[e.kind]] = e.issued
            counts[e.kind] += 1
    counts, exposed = defaultdict(int), 0.0
    for e in mine["events"]:
        i = counts[e.kind]
        counts[e.kind] += 1
        ready = max([e.wait_start] + [issued[(p, e.kind)].get(i, e.issued) for p in mine["group"]])
        exposed += max(0.0, e.wait_end - ready)
    return exposed, mine["alone"]


def _exposed_p2p(per_rank, rank: int) -> tuple:
    """(exposed, alone) seconds of ``rank``'s pipeline receives: the part of each wait after the
    matching send was posted, against that transfer alone."""
    sends = defaultdict(list)
    for peer, result in enumerate(per_rank):
        for o in result["p2p"]:
            if o["send"]:
                sends[(peer, o["peer"])].append(o["issued"])
    counts, exposed, alone = defaultdict(int), 0.0, 0.0
    for o in per_rank[rank]["p2p"]:
        if o["send"] or o["wait_end"] is None:
            continue
        i = counts[o["peer"]]
        counts[o["peer"]] += 1
        posted = sends[(o["peer"], rank)]
        ready = max(o["wait_start"], posted[i] if i < len(posted) else o["issued"])
        exposed += max(0.0, o["wait_end"] - ready)
        alone += per_rank[rank]["p2p_alone"][(o["peer"], o["nbytes"])]
    return exposed, alone


def _row(per_rank, suite) -> dict:
    measure = _exposed_p2p if suite == "pp" else _exposed_collectives
    shares, exposed, alone, step = [], [], [], []
    for rank in range(len(per_rank)):
        e, a = measure(per_rank, rank)
        exposed.append(e / STEPS)
        alone.append(a / STEPS)
        shares.append(1 - e / a if a else float("nan"))
        spans = per_rank[rank]["steps"][:STEPS]
        step.append(statistics.median(end - start for start, end in spans))
    mean = statistics.mean
    return {"hidden": mean(shares), "exposed": 1e3 * mean(exposed), "alone": 1e3 * mean(alone), "step": 1e3 * mean(step)}


def main(suites) -> None:
    import os

    print(f"communication hidden behind compute (CPU, gloo, 1 thread per rank, {os.cpu_count()} cores); "
          f"ms per step, {STEPS} timed steps, mean over ranks")
    print(f"{'what':<8}{'case':<32}{'switch':>8}{'alone':>9}{'exposed':>9}{'hidden':>8}{'step ms':>9}")
    for suite in suites:
        world, cases = SUITES[suite]
        cases = list(cases())
        per_case = list(zip(*_spawn(world, _run_suite, suite)))  # [case][rank]
        for (_, name, on, _), per_rank in zip(cases, per_case):
            row = _row(list(per_rank), suite)
            switch = "-" if suite == "pp" else ("on" if on else "off")
            print(f"{suite:<8}{name:<32}{switch:>8}{row['alone']:>9.2f}{row['exposed']:>9.2f}"
                  f"{100 * row['hidden']:>7.1f}%{row['step']:>9.1f}")


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if a in SUITES] or list(SUITES))
