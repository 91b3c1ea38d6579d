"""The optimizer step on this CPU, Muon (``optim=muon``) against AdamW, at gpt_125m's shape: the same
model, the same gradients, measured in the same run, alternating, median (and best) of rounds.

    python benchmarks/muon_step.py [model=gpt_125m] [rounds=5] [steps=2]

Each round times ``MegatronOptimizer.step`` (clipping, the AdamW kernel, and under Muon the
Newton-Schulz iterations of every hidden matrix) for each optimizer. Prints the times, their
ratio, and the Newton-Schulz FLOPs of ``planning.muon`` with the rate they ran at; asserts nothing.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from megatron_hydra.config import derive
from megatron_hydra.config.bundled import compose
from megatron_hydra.models.gpt import GPTModel
from megatron_hydra.models.init import init_weights
from megatron_hydra.parallel.data_parallel import GradBuffer
from megatron_hydra.parallel.muon import MuonSettings
from megatron_hydra.parallel.optimizer import MegatronOptimizer
from megatron_hydra.parallel.state import ParallelState
from megatron_hydra.planning import muon as muon_plan



def build(cfg, derived, with_muon: bool):
    tcfg, ps = derived.transformer, ParallelState.single()
    model = GPTModel(tcfg, ps)
    init_weights(model, tcfg, cfg.seed, 0, 1)
    buffer = GradBuffer(model.parameters(), None, cfg.parallel.grad_bucket_size)
    o = cfg.optim
    settings = MuonSettings(o.muon_momentum, o.muon_nesterov, o.muon_ns_steps, o.muon_split_qkv) if with_muon else None
    opt = MegatronOptimizer(model, buffer, ps, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay, clip_grad=o.clip_grad, impl=o.impl, muon=settings)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    return model, opt


def step_time(opt, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - start) / steps


def main(argv):
    args = dict(a.split("=", 1) for a in argv)
    model_name, rounds, steps = args.get("model", "gpt_125m"), int(args.get("rounds", 5)), int(args.get("steps", 2))
    cfg = compose([f"model={model_name}", "optim=muon"])
    derived = derive(cfg)
    optimizers = {"adamw": build(cfg, derived, False)[1], "muon": build(cfg, derived, True)[1]}
    for opt in optimizers.values():
        opt.step()  # warm-up: state allocated, kernels chosen
    times = {name: [] for name in optimizers}
    for _ in range(rounds):
        for name, opt in optimizers.items():
            times[name].append(step_time(opt, steps))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{model_name}: optimizer step on {torch.get_num_threads()} threads, median (best) of {rounds} rounds "
          f"of {steps} steps")
    for name, t in times.items():
        print(f"  {name:<6} {median[name] * 1e3:9.1f} ms ({min(t) * 1e3:.1f} ms)")
    print(f"  ratio muon / adamw: {median['muon'] / median['adamw']:.2f}")
    chunks = [(range(derived.transformer.num_layers), True, True)]
    flops = muon_plan.step_flops(muon_plan.rank_matrices(derived.transformer, chunks), cfg.optim.muon_ns_steps)
    print(f"  Newton-Schulz: {flops:.3e} FLOPs per step, {flops / (median['muon'] - median['adamw']) / 1e9:.1f} "
          "GFLOP/s over the time Muon adds")


if __name__ == "__main__":
    main(sys.argv[1:])
