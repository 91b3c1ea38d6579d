"""Overhead of the full launch path (Hydra config -> launcher -> Lightning + MegatronStrategy)
against a bare PyTorch loop training the same model on the same batches (same dataset, same
sampler) with the same optimizer, both measured in this run; plus model TFLOP/s against this machine's measured matmul peak.

    python benchmarks/overhead.py [model=gpt_tiny] [steps=20]

Prints ratios; asserts nothing (machines are noisy: compare numbers from one run only).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from megatron_hydra.config import derive, register_configs
from megatron_hydra.config.machine import resolve
from megatron_hydra.data.builders import build_datasets
from megatron_hydra.data.samplers import GlobalBatchSampler
from megatron_hydra.launcher import run
from megatron_hydra.models.gpt import GPTModel
from megatron_hydra.models.init import init_weights
from megatron_hydra.parallel.optimizer import build_adamw, resolve_impl
from megatron_hydra.parallel.state import ParallelState
from megatron_hydra.planning.flops import model_flops_per_step
from megatron_hydra.planning.peak import measure_cpu_peak_tflops
from megatron_hydra.training.lr_schedule import lr_at

CONF = Path(__file__).resolve().parents[1] / "conf"
WARMUP = 3  # steps excluded from timing on both sides (allocator and thread-pool warm-up)


def bare_loop_step_times(cfg, derived, steps: int):
    tcfg = derived.transformer
    model = GPTModel(tcfg, ParallelState.single())
    init_weights(model, tcfg, cfg.seed, 0, 1)
    o = cfg.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The kernel the launch path picks for this CPU (optim.impl=auto), so both sides step alike.
    opt = build_adamw(groups, resolve_impl(o.impl, torch.device("cpu")), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                      eps=o.adam_eps)
    gbs, nmb = cfg.data.global_batch_size, derived.num_microbatches
    ds, _, _ = build_datasets(cfg.data, seq_length=tcfg.seq_length, seed=cfg.data.seed,
                              num_samples=derived.split_samples, vocab_size=tcfg.vocab_size)
    loader = DataLoader(ds, batch_sampler=GlobalBatchSampler(steps * gbs, gbs, 0, 1))
    times, last = [], time.perf_counter()
    for step, batch in enumerate(loader):
        opt.zero_grad(set_to_none=False)
        for mb in zip(*(v.chunk(nmb) for v in batch.values())):
            mb = dict(zip(batch, mb))
            losses = model(mb["tokens"], mb["labels"])
            loss = (losses * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
            (loss / nmb).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o, cfg.trainer.max_steps)
        opt.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times[WARMUP:]


def main(argv):
    args = dict(a.split("=", 1) for a in argv)
    model, steps = args.get("model", "gpt_tiny"), int(args.get("steps", 20))
    register_configs()
    run_dir = tempfile.mkdtemp(prefix="overhead_")
    overrides = [f"model={model}", f"trainer.max_steps={steps}", "optim.warmup_steps=2",
                 "trainer.enable_progress_bar=false", f"run_dir={run_dir}"]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = resolve(OmegaConf.to_object(compose(config_name="config", overrides=overrides)), visible_gpus=0)
    derived = derive(cfg)
    torch.set_num_threads(torch.get_num_threads())
    peak = measure_cpu_peak_tflops(derived.transformer.hidden_size) * 1e12  # what the run's mfu is taken against

    # Bare loop before and after the launch path, so drift in machine load hits both sides alike.
    bare_before = bare_loop_step_times(cfg, derived, steps)
    run(cfg)  # one process: the worker runs in this process, same threads as the bare loop
    bare = bare_before + bare_loop_step_times(cfg, derived, steps)
    import csv

    with open(Path(run_dir) / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f)][WARMUP:]
    tokens = cfg.data.global_batch_size * derived.transformer.seq_length
    ours_tps = statistics.median(float(r["tokens_per_s"]) for r in rows)
    bare_tps = tokens / statistics.median(bare)
    flops = model_flops_per_step(derived.transformer, cfg.data.global_batch_size)
    print(f"model={model} seq={derived.transformer.seq_length} global_batch={cfg.data.global_batch_size} "
          f"threads={torch.get_num_threads()} steps timed={len(rows)}")
    print(f"bare PyTorch loop     : {bare_tps:10.1f} tokens/s")
    print(f"launch path (Lightning): {ours_tps:10.1f} tokens/s")
    print(f"overhead ratio (ours / bare): {ours_tps / bare_tps:.3f}   (target >= 0.95)")
    model_flops = flops * ours_tps / tokens
    # The peak is the best of its runs, the rate where the cores were free; the like figure of the
    # model is its upper quartile of steps. The median step moves with the host's load: on a shared
    # 2-core host its MFU read 0.48 to 0.62 over five runs; over three more runs the upper quartile
    # read 0.557 to 0.589 where the median read 0.518 to 0.565. On a busier day six runs read 0.513
    # to 0.639 (upper quartile) while the peak held at 204.9 to 206.9 GFLOP/s: the noise left is the
    # model's own rate under the host's load.
    rates = [float(r["tokens_per_s"]) for r in rows]
    fast_flops = flops * (statistics.quantiles(rates, n=4)[2] if len(rates) > 1 else rates[0]) / tokens
    print(f"matmul peak {peak / 1e9:.1f} GFLOP/s; model {model_flops / 1e9:.1f} GFLOP/s (median step), "
          f"{fast_flops / 1e9:.1f} GFLOP/s (upper quartile of steps)")
    print(f"CPU MFU {fast_flops / peak:.3f} (upper quartile against the best matmul; "
          f"median step: {model_flops / peak:.3f})")


if __name__ == "__main__":
    main(sys.argv[1:])
