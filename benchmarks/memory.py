"""Activation memory and step time with no, selective and full recompute; optimizer bytes per rank
with and without the distributed optimizer.

    python benchmarks/memory.py [--layers 4] [--seq 512] [--micro-batch 2] [--dropout 0] [--repeats 3]

Part 1, on this CPU: a stack of gpt_125m-sized layers (h = 768, 12 heads, ffn 3072, fp32) runs
forward + backward; a saved-tensor hook counts the bytes autograd keeps for backward (distinct
storages, weights excluded) and each step is timed, as wall time and as this process's CPU time.
Settings run round-robin, ``repeats`` times after a warm-up, and the median counts, so a load
change on the machine hits every setting alike; the ratios use CPU time, which other processes
competing for the cores do not inflate (on an idle machine the two agree).
Ratios are against no recompute, measured in the same run; the formula column is the memory
plan's per-layer formula (``planning.activations.activation_bytes_per_layer``) for the same shape.
Dropout defaults to 0, as in ``conf/model/gpt_125m.yaml``: attention then runs torch's fused CPU
kernel, as it does on GPU. With ``--dropout 0.1`` (the paper's setting) CPU attention falls back to
the unfused path, whose s^2 softmax and dropout tensors the formula counts, and CPU dropout
(drawing and applying a float mask) makes the forward about as slow as the backward, so recompute
costs far more time than on a GPU.

Part 2: optimizer bytes (Adam moments; fp32 main weights are none for an fp32 model) per rank of
gpt_125m at dp 1, 2, 4 from the memory plan, and from a real two-step run of a small GPT on dp2
and dp4 gloo ranks (the tensors in the optimizer's state after a step), with and without
``optim.distributed_optimizer``. Prints, does not assert.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_hydra.config.transformer_config import TransformerConfig  # noqa: E402
from megatron_hydra.models.transformer import Block  # noqa: E402
from megatron_hydra.parallel.random import seed_model_parallel  # noqa: E402
from megatron_hydra.parallel.recompute import run_layers  # noqa: E402
from megatron_hydra.parallel.state import ParallelState  # noqa: E402
from megatron_hydra.planning.activations import activation_bytes_per_layer  # noqa: E402

SETTINGS = {"none": None, "selective": "selective", "full": "full"}
SMALL_RUN = ["data=synthetic", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
             "model.seq_length=32", "model.vocab_size=500", "data.micro_batch_size=2", "data.global_batch_size=8",
             "optim.warmup_steps=1", "trainer.max_steps=2", "trainer.enable_progress_bar=false",
             "checkpoint.save_last=false"]


def compose(overrides, run_dir="unused"):
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megatron_hydra.config import register_configs
    from megatron_hydra.config.machine import resolve

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=[f"run_dir={run_dir}", *overrides])
    return resolve(OmegaConf.to_object(cfg), visible_gpus=0)  # measured on this CPU


# Part 1: activations and step time ---------------------------------------------------------------

def layer_config(args, granularity) -> TransformerConfig:
    h, heads = 768, 12
    return TransformerConfig(num_layers=args.layers, hidden_size=h, num_attention_heads=heads, num_query_groups=heads,
                             kv_channels=h // heads, ffn_hidden_size=4 * h, seq_length=args.seq,
                             max_position_embeddings=args.seq, vocab_size=50257, padded_vocab_size=50304,
                             hidden_dropout=args.dropout, attention_dropout=args.dropout,
                             recompute_granularity=granularity)


def build(cfg: TransformerConfig):
    seed_model_parallel(1, 0)
    blocks = [Block(cfg, ParallelState.single()) for _ in range(cfg.num_layers)]
    for block in blocks:
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        block.train()
    return blocks


def step(blocks, cfg, x, grad_out) -> tuple:
    """One forward + backward; returns (bytes kept for backward, wall seconds, CPU seconds)."""
    weights = {p.untyped_storage().data_ptr() for b in blocks for p in b.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    start, cpu = time.perf_counter(), time.process_time()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_layers(blocks, x, cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers, True)
    out.backward(grad_out)
    return sum(saved.values()), time.perf_counter() - start, time.process_time() - cpu


def activations(args) -> None:
    cfgs = {name: layer_config(args, g) for name, g in SETTINGS.items()}
    models = {name: build(cfg) for name, cfg in cfgs.items()}
    x = torch.randn(args.micro_batch, args.seq, 768, requires_grad=True)
    grad_out = torch.randn_like(x)
    wall, cpu = {name: [] for name in SETTINGS}, {name: [] for name in SETTINGS}
    kept = {}
    for rep in range(args.repeats + 1):
        for name in SETTINGS:
            kept[name], seconds, cpu_seconds = step(models[name], cfgs[name], x, grad_out)
            if rep:  # the first round warms up
                wall[name].append(seconds)
                cpu[name].append(cpu_seconds)
    print(f"\n{args.layers} layers of gpt_125m size (h=768, 12 heads), seq {args.seq}, micro-batch {args.micro_batch}, "
          f"dropout {args.dropout}, fp32, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'recompute':<11}{'kept MiB':>10}{'formula MiB':>13}{'vs none':>9}{'wall s':>9}{'CPU s':>9}{'vs none':>9}")
    base_bytes, base_time = kept["none"], statistics.median(cpu["none"])
    for name, granularity in SETTINGS.items():
        formula = args.layers * activation_bytes_per_layer(
            args.seq, args.micro_batch, 768, 12, recompute=granularity, value_bytes=4, mask_bytes=4,
            hidden_dropout=args.dropout > 0, attention_dropout=args.dropout > 0,
            attention="unfused" if args.dropout > 0 else "fused")
        t = statistics.median(cpu[name])
        print(f"{name:<11}{kept[name] / 2**20:>10.1f}{formula / 2**20:>13.1f}{kept[name] / base_bytes:>9.3f}"
              f"{statistics.median(wall[name]):>9.3f}{t:>9.3f}{t / base_time:>9.3f}")
    cut = 1 - kept["full"] / base_bytes
    more = statistics.median(cpu["full"]) / base_time - 1
    print(f"full recompute: activation memory -{cut:.1%} for +{more:.1%} step CPU time (target: >= 70% for <= 40%)")


# Part 2: optimizer bytes per rank -----------------------------------------------------------------

def planned_optimizer_bytes() -> None:
    from megatron_hydra.config import derive
    from megatron_hydra.planning.memory import plan_memory

    print("\ngpt_125m (12 layers, seq 2048), optimizer bytes per rank from the memory plan (fp32 model):")
    print(f"{'dp':>3}{'plain MiB':>12}{'distributed MiB':>17}{'ratio':>8}")
    for dp in (1, 2, 4):
        row = []
        for distributed in (False, True):
            cfg = compose(["model=gpt_125m", f"trainer.devices={dp}", f"data.global_batch_size={4 * dp}",
                           f"optim.distributed_optimizer={str(distributed).lower()}", "trainer.device_memory_gb=80"])
            row.append(plan_memory(cfg, derive(cfg)).peak.optimizer_bytes)
        print(f"{dp:>3}{row[0] / 2**20:>12.1f}{row[1] / 2**20:>17.1f}{row[1] / row[0]:>8.3f}")


def _rank(rank, world, port, overrides, run_dir, queue):
    import pytorch_lightning as pl
    import torch.distributed as dist

    from megatron_hydra.config import derive
    from megatron_hydra.training import train as train_module

    quiet = os.open(os.devnull, os.O_WRONLY)  # the table is printed by the parent
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    counted = {}

    class Count(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            opt = trainer.optimizers[0]
            moments = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                       for state in opt.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")}
            counted["optimizer"] = sum(moments.values())
            counted["weights"] = sum(p.numel() * p.element_size() for p in pl_module.parameters())

    build = train_module.build_trainer

    def with_counter(*a, **k):
        trainer = build(*a, **k)
        trainer.callbacks.append(Count())
        return trainer

    train_module.build_trainer = with_counter
    cfg = compose(overrides, run_dir)
    train_module.train(cfg, derive(cfg), local_rank=rank)
    queue.put((rank, counted))
    dist.destroy_process_group()


def measured_optimizer_bytes() -> None:
    import torch.multiprocessing as mp

    from megatron_hydra.config.io import free_port

    print("\nsmall GPT (2 layers, h=64), optimizer bytes per rank counted in a real run (rank 0):")
    print(f"{'dp':>3}{'weights KiB':>13}{'plain KiB':>11}{'distributed KiB':>17}{'ratio':>8}")
    for dp in (2, 4):
        row = []
        for distributed in (False, True):
            overrides = [*SMALL_RUN, f"trainer.devices={dp}", f"optim.distributed_optimizer={str(distributed).lower()}"]
            ctx = mp.get_context("spawn")
            queue = ctx.SimpleQueue()
            with tempfile.TemporaryDirectory() as run_dir:
                mp.start_processes(_rank, args=(dp, free_port(), overrides, run_dir, queue), nprocs=dp,
                                   start_method="spawn")
            results = dict(queue.get() for _ in range(dp))
            row.append(results[0])
        plain, sharded = row[0]["optimizer"], row[1]["optimizer"]
        print(f"{dp:>3}{row[0]['weights'] / 1024:>13.1f}{plain / 1024:>11.1f}{sharded / 1024:>17.1f}{sharded / plain:>8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-real-run", action="store_true", help="part 2 from the plan only")
    args = parser.parse_args()
    activations(args)
    planned_optimizer_bytes()
    if not args.skip_real_run:
        measured_optimizer_bytes()


if __name__ == "__main__":
    main()
