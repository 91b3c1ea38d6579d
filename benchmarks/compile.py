"""``trainer.compile`` on this CPU: training tokens/s of the eager blocks against the same model with
every block compiled (``models.compile``), and each backend's cold-compile time, measured in the same
run.

    python benchmarks/compile.py [steps=8] [backends=aot_eager,inductor] [extra overrides...]

Each side is the model a run builds (``models.stages.build_model``), fp32, one process, with its
gradient buffer and optimizer; a step is a pp=1 training step (forward and backward of the batch,
the reduction's end, the optimizer step), on the same batch for every side. Cold compile: the first
step's wall time minus the median of the warm steps that follow. Eager runs first and last, and the
faster of the two is the baseline (the machine's load drifts). Prints tokens/s per side, its
ratio to eager, the cold time, and the largest relative difference of a side's losses from
eager's; asserts nothing.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from megatron_hydra.config import derive
from megatron_hydra.config.bundled import compose
from megatron_hydra.models.compile import compile_blocks
from megatron_hydra.models.stages import build_model
from megatron_hydra.parallel.data_parallel import GradBuffer
from megatron_hydra.parallel.optimizer import MegatronOptimizer
from megatron_hydra.parallel.state import ParallelState

MODEL = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "model.seq_length=128",
         "model.vocab_size=2048", "precision=fp32", "data.micro_batch_size=4", "data.global_batch_size=4"]


def config(overrides):
    cfg = compose(overrides)  # this CPU, as launch.py resolves it
    return cfg, derive(cfg)


def measure(cfg, derived, backend, batch, steps: int) -> dict:
    """Step times and losses of one side (``backend`` None: eager)."""
    torch.compiler.reset()
    ps = ParallelState.single()
    model = build_model(cfg, derived, ps, torch.device("cpu")).train()
    if backend is not None:
        compile_blocks(model, backend)
    buffer = GradBuffer(model.parameters(), None, cfg.parallel.grad_bucket_size)
    o = cfg.optim
    opt = MegatronOptimizer(model, buffer, ps, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay, clip_grad=o.clip_grad, impl=o.impl)
    times, losses = [], []
    for _ in range(steps + 1):
        start = time.perf_counter()
        buffer.zero()
        loss = model(*batch).mean()
        loss.backward()
        buffer.finish()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    opt.close()
    buffer.close()
    warm = statistics.median(times[1:])
    return {"step_s": warm, "cold_s": max(times[0] - warm, 0.0), "losses": losses}


def main(argv) -> None:
    steps, backends, extra = 8, ["aot_eager", "inductor"], []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "steps":
            steps = int(value)
        elif key == "backends":
            backends = value.split(",")
        else:
            extra.append(arg)
    cfg, derived = config([*MODEL, *extra])
    t = derived.transformer
    tokens = derived.global_batch_size * t.seq_length
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, t.vocab_size, (derived.global_batch_size, t.seq_length), generator=gen) for _ in range(2)]
    print(f"GPT {t.num_layers} layers, hidden {t.hidden_size}, seq {t.seq_length}, batch {derived.global_batch_size}, "
          f"fp32, {torch.get_num_threads()} threads, {steps} warm steps after the first")
    print(f"{'side':<12}{'tokens/s':>10}{'x eager':>9}{'cold compile s':>16}{'max loss diff':>15}")
    eager = measure(cfg, derived, None, batch, steps)
    compiled = {name: measure(cfg, derived, name, batch, steps) for name in backends}
    again = measure(cfg, derived, None, batch, steps)  # eager before and after: the faster counts
    eager = min(eager, again, key=lambda r: r["step_s"])
    for name in ["eager", *backends]:
        r = eager if name == "eager" else compiled[name]
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], eager["losses"]))
        cold = "-" if name == "eager" else f"{r['cold_s']:.1f}"
        print(f"{name:<12}{tokens / r['step_s']:>10.0f}{eager['step_s'] / r['step_s']:>9.2f}{cold:>16}{diff:>15.1e}")


if __name__ == "__main__":
    main(sys.argv[1:])
