"""LoRA against full fine-tuning on this CPU: training tokens/s of the same model and batch, and
the optimizer-side bytes of each, measured in the same run, alternating, median of several rounds.

    python benchmarks/lora_throughput.py [model=gpt_tiny] [rounds=7] [rank=16] [extra overrides...]

Each side is the model a run builds (``models.stages.build_model``: under ``peft=lora`` the base
frozen, adapters on every target layer), its gradient buffer and ``MegatronOptimizer``; a step is
what a pp=1 training step does: zero the buffer, forward and backward of the global batch, finish
the reduction, the optimizer step. It prints tokens/s per side (median and best of the rounds,
the ratio LoRA / full), the parameters that train, and the bytes of gradients, fp32 main weights
and Adam state each side holds after a step (counted from the tensors), beside the memory plan's
columns for the same run; asserts nothing.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from megatron_hydra.config import derive
from megatron_hydra.config.bundled import compose
from megatron_hydra.models.stages import build_model
from megatron_hydra.parallel.data_parallel import GradBuffer
from megatron_hydra.parallel.optimizer import MegatronOptimizer
from megatron_hydra.parallel.state import ParallelState
from megatron_hydra.planning.memory import rank_memory

SIDES = ("full", "lora")


def config(overrides):
    cfg = compose(overrides)  # this CPU, as launch.py resolves it
    return cfg, derive(cfg)


def build(cfg, derived):
    ps = ParallelState.single()
    model = build_model(cfg, derived, ps, torch.device("cpu"))
    model.train()
    buffer = GradBuffer(model.parameters(), None, cfg.parallel.grad_bucket_size)
    o = cfg.optim
    opt = MegatronOptimizer(model, buffer, ps, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay, clip_grad=o.clip_grad, impl=o.impl)
    return model, buffer, opt


def step(model, buffer, opt, batch) -> float:
    tokens, labels = batch
    start = time.perf_counter()
    buffer.zero()
    model(tokens, labels).mean().backward()
    buffer.finish()
    opt.step()
    return time.perf_counter() - start


def _bytes(tensors) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def state_bytes(model, buffer, opt) -> dict:
    """Gradients (the buffer), main weights (optimizer parameters that are no model parameter's
    storage) and Adam's moments, as the tensors hold them."""
    own = {p.untyped_storage()._cdata for p in model.parameters()}
    main = [q for group in opt.param_groups for q in group["params"] if q.untyped_storage()._cdata not in own]
    moments = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return {"trained": sum(p.numel() for p in buffer.params), "params": sum(p.numel() for p in model.parameters()),
            "grads": _bytes([buffer.buffer]), "main": _bytes(main), "optimizer": _bytes(moments)}


def main(argv):
    args = dict(a.split("=", 1) for a in argv if "=" in a and a.split("=", 1)[0] in ("model", "rounds", "rank"))
    extra = [a for a in argv if a.split("=", 1)[0] not in ("model", "rounds", "rank")]
    model_name, rounds, rank = args.get("model", "gpt_tiny"), int(args.get("rounds", 7)), int(args.get("rank", 16))
    base = [f"model={model_name}", *extra]
    runs = {"full": config(base), "lora": config([*base, "peft=lora", f"peft.rank={rank}"])}
    built = {side: build(*runs[side]) for side in SIDES}
    tcfg = runs["full"][1].transformer
    gen = torch.Generator().manual_seed(1)
    shape = (runs["full"][0].data.global_batch_size, tcfg.seq_length)
    batch = (torch.randint(0, tcfg.vocab_size, shape, generator=gen), torch.randint(0, tcfg.vocab_size, shape, generator=gen))
    for side in SIDES:  # warm-up: allocator, thread pool, Adam state
        step(*built[side], batch)
    times = {side: [] for side in SIDES}
    for _ in range(rounds):  # alternate, so that drift in machine load hits both alike
        for side in SIDES:
            times[side].append(step(*built[side], batch))
    tokens = shape[0] * shape[1]
    print(f"model={model_name} batch={shape[0]}x{shape[1]} threads={torch.get_num_threads()} rounds={rounds}, "
          f"alternating; LoRA rank {rank} on {', '.join(runs['lora'][1].transformer.lora.targets)}")
    print(f"{'side':6s} {'tokens/s median':>16s} {'(best)':>9s} {'trained':>12s} {'grads MiB':>10s} "
          f"{'main MiB':>9s} {'Adam MiB':>9s}   plan: grads / main / Adam MiB")
    rates = {}
    for side in SIDES:
        rates[side] = tokens / statistics.median(times[side])
        s = state_bytes(*built[side])
        plan = rank_memory(*runs[side], 0)
        mib = 2**20
        print(f"{side:6s} {rates[side]:16.0f} {tokens / min(times[side]):9.0f} {s['trained']:12,d} "
              f"{s['grads'] / mib:10.2f} {s['main'] / mib:9.2f} {s['optimizer'] / mib:9.2f}   "
              f"{plan.grad_bytes / mib:.2f} / {plan.main_weight_bytes / mib:.2f} / {plan.optimizer_bytes / mib:.2f}")
    print(f"LoRA / full tokens/s: {rates['lora'] / rates['full']:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
