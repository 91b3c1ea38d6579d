"""AdamW kernels on this machine: torch's fused AdamW against its foreach one (and against the
single-tensor loop, torch's own CPU default), for gpt_tiny's parameters, measured in the same
run, alternating, best (and median) of several rounds.

    python benchmarks/adamw_impl.py [model=gpt_tiny] [rounds=9] [steps=5]

For each kernel it times, fp32, over the model's parameters: (1) the AdamW kernel alone (the inner
optimizer's ``step``), (2) our whole optimizer step (``MegatronOptimizer.step``: the kernel plus
gradient clipping and the rest), and (3) a whole training step (forward and backward of the
model's global batch, then the optimizer step) as tokens/s. Prints best and median times and the
ratio of optimizer steps to ``fused``; asserts nothing.

Measured here (torch 2.13 CPU build, 2 threads, gpt_tiny: 5.3M parameters, global batch 8 x 256
tokens; other jobs kept the load average at 5-7 on the 2 cores, so medians are noisy and the best
times are the uncontended ones; a bare torch.optim.AdamW over the same tensors, 15 rounds, gave
the same order: fused 2.9 ms, loop 13.4 ms, foreach 18.0 ms):

    impl      AdamW kernel   optimizer step   ratio to fused   training tokens/s
    fused         3.8 ms          6.2 ms           1.00              3303
    foreach      10.1 ms         12.5 ms           2.03              3180
    loop          9.6 ms         15.1 ms           2.44              3075

So on CPU ``optim.impl=auto`` is torch's fused AdamW (``parallel.optimizer.CPU_IMPL``): half the
optimizer step of foreach, ~4% more training tokens/s on gpt_tiny. (On CUDA ``auto`` is fused too.)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megatron_hydra.config import derive, register_configs
from megatron_hydra.models.gpt import GPTModel
from megatron_hydra.models.init import init_weights
from megatron_hydra.parallel.data_parallel import GradBuffer
from megatron_hydra.parallel.optimizer import MegatronOptimizer
from megatron_hydra.parallel.state import ParallelState

CONF = Path(__file__).resolve().parents[1] / "conf"
IMPLS = ("fused", "foreach", "loop")  # loop: torch.optim.AdamW(foreach=False), the CPU default before impl


def build(cfg, derived, impl: str):
    tcfg, ps = derived.transformer, ParallelState.single()
    model = GPTModel(tcfg, ps)
    init_weights(model, tcfg, cfg.seed, 0, 1)
    buffer = GradBuffer(model.parameters(), None, cfg.parallel.grad_bucket_size)
    o = cfg.optim
    opt = MegatronOptimizer(model, buffer, ps, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay, clip_grad=o.clip_grad, impl="foreach" if impl == "loop" else impl)
    if impl == "loop":
        for group in opt.param_groups:
            group["foreach"] = False
    return model, buffer, opt


def set_gradients(model) -> None:
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=gen) * 1e-3)


def step_time(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def training_step_time(model, buffer, opt, batch, steps: int) -> float:
    tokens, labels = batch
    start = time.perf_counter()
    for _ in range(steps):
        buffer.zero()
        model(tokens, labels).mean().backward()
        buffer.finish()
        opt.step()
    return (time.perf_counter() - start) / steps


def main(argv):
    args = dict(a.split("=", 1) for a in argv)
    model_name, rounds, steps = args.get("model", "gpt_tiny"), int(args.get("rounds", 9)), int(args.get("steps", 5))
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=[f"model={model_name}", "run_dir=unused"]))
    derived = derive(cfg)
    tcfg = derived.transformer
    built = {impl: build(cfg, derived, impl) for impl in IMPLS}
    gen = torch.Generator().manual_seed(1)
    shape = (cfg.data.global_batch_size, tcfg.seq_length)
    batch = (torch.randint(0, tcfg.vocab_size, shape, generator=gen), torch.randint(0, tcfg.vocab_size, shape, generator=gen))
    times = {impl: {"adamw": [], "optimizer": [], "training": []} for impl in IMPLS}
    for impl in IMPLS:  # warm-up: allocator, thread pool, Adam state
        training_step_time(*built[impl], batch, 1)
        set_gradients(built[impl][0])
    for _ in range(rounds):  # alternate, so that drift in machine load hits every impl alike
        for impl in IMPLS:
            model, buffer, opt = built[impl]
            times[impl]["adamw"].append(step_time(opt.inner.step, steps))
            times[impl]["optimizer"].append(step_time(opt.step, steps))
            times[impl]["training"].append(training_step_time(model, buffer, opt, batch, 1))
            set_gradients(model)
    params = sum(p.numel() for p in built["fused"][0].parameters())
    tokens = shape[0] * shape[1]
    best = {impl: {k: min(v) for k, v in t.items()} for impl, t in times.items()}
    median = {impl: {k: statistics.median(v) for k, v in t.items()} for impl, t in times.items()}
    print(f"model={model_name} params={params / 1e6:.1f}M batch={shape[0]}x{shape[1]} threads={torch.get_num_threads()} "
          f"rounds={rounds} x {steps} steps, alternating; best (median) of the rounds")
    print(f"{'impl':8s} {'AdamW kernel':>18s} {'optimizer step':>18s} {'ratio to fused':>15s} {'training tokens/s':>22s}")
    for impl in IMPLS:
        b, m = best[impl], median[impl]
        print(f"{impl:8s} {b['adamw'] * 1e3:7.1f} ({m['adamw'] * 1e3:6.1f}) ms {b['optimizer'] * 1e3:7.1f} "
              f"({m['optimizer'] * 1e3:6.1f}) ms {b['optimizer'] / best['fused']['optimizer']:15.2f} "
              f"{tokens / b['training']:11.0f} ({tokens / m['training']:6.0f})")


if __name__ == "__main__":
    main(sys.argv[1:])
