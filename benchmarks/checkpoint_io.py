"""Checkpoint save/load throughput per rank, and how long a save blocks training.

    python benchmarks/checkpoint_io.py [layers=12] [layouts=single,dp2,tp2,zero1_dp2,zero1_dp4]

gpt_125m-shaped parameters (h=768, 12 heads, vocab 50257; ``layers`` may be lowered to fit a small
machine) with one step of AdamW state, saved through ``megatron_hydra.checkpoint.sharded`` into a
temporary directory and loaded back, on CPU with gloo. A synchronous save blocks training for the
whole save call (the barrier-to-barrier time of the slowest rank); an asynchronous one
(``checkpoint.async_save``) only while ``sharded.snapshot`` stages the state to host memory, the
write then running on a background thread over a gloo group of its own. Both are measured in the
same run, the asynchronous save twice (the first allocates the staging buffers, the second reuses
them, as every later save of a run does), and so is an AdamW step (every parameter and its state
read and written) with no save in flight and while the second asynchronous save is written.
The peak resident memory a save and a load add on each rank (``VmHWM``) is printed beside the
rank's shard of the checkpoint (its optimizer state and its 1/dp of the weights) plus one gradient
bucket, the most they may add; ``zero1_dp2`` and ``zero1_dp4`` run the distributed optimizer.
Prints numbers; asserts nothing (machines are noisy: compare numbers from one run only).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from megatron_hydra.training.memory_peak import resident_peak_added

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"single": (1, ["parallel=single"]), "dp2": (2, ["parallel=single"]), "tp2": (2, ["parallel=tp2"]),
           "zero1_dp2": (2, ["parallel=single", "optim.distributed_optimizer=true"]),
           "zero1_dp4": (4, ["parallel=single", "optim.distributed_optimizer=true"])}


def _config(layers: int, world: int, layout):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megatron_hydra.config import register_configs
    from megatron_hydra.config.machine import resolve

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[
            "run_dir=unused", "model=gpt_125m", f"model.num_layers={layers}", "model.seq_length=128",
            "data=synthetic", f"trainer.devices={world}", "data.micro_batch_size=1", f"data.global_batch_size={max(2, world)}",
            *layout])
    return resolve(OmegaConf.to_object(cfg), visible_gpus=0)


def _rank(rank: int, world: int, port: int, layers: int, layout, path: str, queue) -> None:
    import torch.distributed as dist

    from megatron_hydra.checkpoint.async_save import BackgroundWriter, HostStager
    from megatron_hydra.checkpoint.sharded import load, save, snapshot, write
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = _config(layers, world, layout)
    derived = derive(cfg)
    ps = ParallelState.build(tp=derived.tp, pp=derived.pp, dp=derived.dp)
    module = LMModule(cfg, derived, ps)
    buffer = GradBuffer(module.model.parameters(), ps.dp_cp_group, cfg.parallel.grad_bucket_size,
                        distributed=cfg.optim.distributed_optimizer)
    opt = module.build_optimizer(buffer)
    for p in module.model.parameters():
        p.main_grad.fill_(1e-3)
    buffer.finish()
    opt.step()
    opt.finish_param_gather()
    weights = sum(p.numel() * p.element_size() for p in module.model.parameters())
    local = weights + opt.optimizer_bytes() + opt.main_weight_bytes()
    vocab = derived.transformer.vocab_size
    results = {}
    for phase in ("save", "load"):
        dist.barrier()
        start = time.perf_counter()
        if phase == "save":
            extra = resident_peak_added(lambda: save(path, module.model, opt, ps, vocab, {"step": 1}))
        else:
            extra = resident_peak_added(lambda: load(path, module.model, opt, ps, vocab))
        dist.barrier()
        results[phase] = time.perf_counter() - start
        results[f"{phase}_extra"] = extra
    results["shard"] = weights // ps.dp_size + opt.optimizer_bytes() + opt.main_weight_bytes()
    results["bucket"] = max(b.end - b.start for b in buffer.buckets) * 4
    results["gathered"] = buffer.buffer.numel() * 4 * (3 if opt.separate else 2)  # the state unsharded
    group, stager, writer = dist.new_group(backend="gloo"), HostStager(), BackgroundWriter()

    def timed_step() -> float:
        begin = time.perf_counter()
        opt.step()
        return time.perf_counter() - begin

    results["step_idle"] = sorted(timed_step() for _ in range(3))[1]
    for i in range(2):  # cold (buffers allocated), then warm (buffers reused)
        target = f"{path}_async{i}"
        dist.barrier()
        start = time.perf_counter()
        snap = snapshot(target, module.model, opt, ps, vocab, {"step": 1}, stage=stager.stage)
        writer.submit(target, lambda snap=snap: write(snap, group))
        results[f"async_blocked{i}"] = time.perf_counter() - start
        steps = [timed_step() for _ in range(3)]
        overlapped = writer.in_flight
        writer.wait()
        results[f"async_total{i}"] = time.perf_counter() - start
        if i == 1:
            results["step_in_flight"], results["overlapped"] = sorted(steps)[1], overlapped
    dist.barrier()
    queue.put((rank, local, results))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(name: str, layers: int) -> None:
    world, layout = LAYOUTS[name]
    tmp = tempfile.mkdtemp(prefix="ckpt_bench_")
    path = os.path.join(tmp, "step_0000001")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(world, _free_port(), layers, layout, path, queue), nprocs=world,
                       start_method="spawn", join=True)
    rows = sorted(queue.get() for _ in range(world))
    on_disk = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    shutil.rmtree(tmp)
    def slowest(key):
        return max(r[2][key] for r in rows)

    save_s, load_s = slowest("save"), slowest("load")
    per_rank = sum(r[1] for r in rows) / world / 2**20
    print(f"{name:7s} world={world}  state/rank={per_rank:8.1f} MiB  on disk={on_disk / 2**20:8.1f} MiB  "
          f"save {save_s:6.2f} s ({per_rank / save_s:7.1f} MiB/s/rank)  "
          f"load {load_s:6.2f} s ({per_rank / load_s:7.1f} MiB/s/rank)")
    cold, warm = slowest("async_blocked0"), slowest("async_blocked1")
    print(f"{'':7s} training blocked per save: sync {save_s:6.3f} s  async {warm:6.3f} s "
          f"(first save, allocating its buffers: {cold:6.3f} s)  async/sync {100 * warm / save_s:5.1f}%  "
          f"async save done after {slowest('async_total1'):6.2f} s")
    def largest(key):
        return max(r[2][key] for r in rows) / 2**20

    print(f"{'':7s} peak extra memory per rank: save {largest('save_extra'):6.1f} MiB  load {largest('load_extra'):6.1f} "
          f"MiB  (the rank's shard of the checkpoint {largest('shard'):6.1f} MiB + one bucket "
          f"{largest('bucket'):6.1f} MiB; the state gathered whole: {largest('gathered'):6.1f} MiB)")
    overlapped = all(r[2]["overlapped"] for r in rows)
    print(f"{'':7s} AdamW step: {slowest('step_idle'):6.3f} s idle, {slowest('step_in_flight'):6.3f} s while the "
          f"save is written{'' if overlapped else ' (the write ended before the third step)'}")


def main(argv) -> None:
    args = dict(a.split("=", 1) for a in argv)
    layers = int(args.get("layers", 12))
    print(f"gpt_125m-shaped, {layers} layers, fp32 params + AdamW state, CPU/gloo, {os.cpu_count()} cores")
    print("(layouts: " + ", ".join(LAYOUTS) + ")")
    for name in args.get("layouts", ",".join(LAYOUTS)).split(","):
        measure(name, layers)


if __name__ == "__main__":
    main(sys.argv[1:])
