"""Mixture of Experts: the expert all-to-all's bytes, throughput against a dense model, load balance.

    python benchmarks/moe.py [--steps 200] [--rounds 2]

(a) All-to-all volume. ep gloo ranks (ep = 2, 4) run one MoE layer of moe_tiny's shape (h 256,
8 SwiGLU experts of ffn 256, top-2, fp32) forward and backward on T = 4 x 256 tokens each, under
``collectives.count_comm()`` (counted: what each rank hands to the collective). Analytic, per rank
and pass: the counts exchange (E int64) and four token exchanges (dispatch and combine, forward
and backward). Over the group every assignment is sent once per exchange, so the mean per rank is
exactly ``8 E + 4 T k h e`` bytes (e = 4) whatever the routing. Of that, the share that leaves the
rank depends on the routing; balanced routing (the layout planner's assumption) sends
``(ep-1)/ep`` of it: the table prints the measured share against that.

(b) Throughput. ``model=moe_tiny`` against the same model with a dense MLP of the same *active*
width (ffn 512 = top-2 x 256: the MLP parameters a token runs through are equal, the router's
8 x 256 per layer aside), trained on the bundled demo corpus on one CPU process, in alternating
rounds; tokens/s is the median of each run's logged steps after the first five.

(c) Load balance. moe_tiny trained ``--steps`` steps on the demo corpus with the load-balancing
loss (``aux_loss_coeff`` 0.01) and without it (0): ``moe_load_imbalance`` (the worst layer's max /
mean tokens per expert; 1 is balanced), averaged over the last 10 steps.

Prints, asserts nothing.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from context_parallel import _spawn  # noqa: E402  (one gloo rank per process, every rank's result)

ROOT = Path(__file__).resolve().parents[1]
H, FFN, E, K, TOKENS = 256, 256, 8, 2, 4 * 256


def _a2a_rank(rank: int, ep: int) -> tuple:
    """(bytes counted in the expert exchanges, bytes that left this rank), on a running gloo group."""
    from megatron_hydra.config.transformer_config import MoESpec, TransformerConfig
    from megatron_hydra.models.init import init_weights
    from megatron_hydra.models.moe import MoELayer
    from megatron_hydra.parallel import collectives as C
    from megatron_hydra.parallel import expert_dispatch
    from megatron_hydra.parallel.state import ParallelState

    ps = ParallelState.build(dp=ep, ep=ep)
    holder = torch.nn.Module()
    holder.mlp = layer = MoELayer(MoESpec(num_experts=E, ffn_hidden_size=FFN, top_k=K, aux_loss_coeff=0.01), H,
                                  "swiglu", ps)
    shape = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=8, num_query_groups=8, kv_channels=32,
                              ffn_hidden_size=FFN, seq_length=TOKENS, max_position_embeddings=TOKENS,
                              vocab_size=8, padded_vocab_size=8)
    init_weights(holder, shape, seed=1234, tp_rank=0, tp_size=1)  # the run's initial router and experts
    torch.manual_seed(1 + rank)  # each rank its own tokens
    plans = []
    original = expert_dispatch.plan

    def recorded(*args, **kwargs):
        plans.append(original(*args, **kwargs))
        return plans[-1]

    expert_dispatch.plan = recorded
    x = torch.randn(4, TOKENS // 4, H, requires_grad=True)
    with C.count_comm() as comm:
        layer(x).square().sum().backward()
    (p,) = plans
    # Rows leaving this rank: dispatch forward and combine backward send p.send_splits, combine
    # forward and dispatch backward p.recv_splits; minus what stays home.
    away = 2 * (sum(p.send_splits) - p.send_splits[rank] + sum(p.recv_splits) - p.recv_splits[rank])
    return comm.bytes["ep_a2a"], away * H * 4


def all_to_all_volume() -> None:
    print("(a) expert all-to-all bytes per rank, one MoE layer forward + backward "
          f"(T={TOKENS} tokens, h={H}, E={E}, top-{K}, fp32)")
    print(f"{'ep':>3} {'counted':>12} {'analytic':>12} {'ratio':>7} {'left rank':>12} {'balanced':>12} {'ratio':>7}")
    for ep in (2, 4):
        per_rank = _spawn(ep, _a2a_rank)  # benchmarks/context_parallel.py: one gloo rank per process
        counted = statistics.fmean(c for c, _ in per_rank)
        away = statistics.fmean(a for _, a in per_rank)
        analytic = 8 * E + 4 * TOKENS * K * H * 4
        balanced = (ep - 1) / ep * 4 * TOKENS * K * H * 4
        print(f"{ep:>3} {counted:>12.0f} {analytic:>12.0f} {counted / analytic:>7.4f} {away:>12.0f} {balanced:>12.0f} "
              f"{away / balanced:>7.3f}")


def _train(overrides, run_dir: Path) -> list:
    cmd = [sys.executable, str(ROOT / "launch.py"), "data=demo", f"hydra.run.dir={run_dir}", "checkpoint.every_n_steps=0",
           "trainer.val_check_interval=0", "trainer.generate_sample_tokens=0", *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(overrides)} failed: {done.stderr.strip().splitlines()[-1:]}")
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def throughput(rounds: int, steps: int, tmp: Path) -> None:
    runs = {"moe_tiny (8 experts, top-2)": ["model=moe_tiny"],
            "dense, same active MLP (ffn 512)": ["model=moe_tiny", "model.moe=null", "model.ffn_hidden_size=512"]}
    speeds = {name: [] for name in runs}
    for i in range(rounds):
        for name, overrides in runs.items():
            rows = _train([*overrides, f"trainer.max_steps={steps}"], tmp / f"speed_{i}_{len(speeds[name])}_{hash(name)}")
            speeds[name].append(statistics.median(r["tokens_per_s"] for r in rows[5:]))
    moe, dense = (statistics.median(v) for v in speeds.values())
    print(f"\n(b) tokens/s on CPU, one process, {rounds} alternating rounds of {steps} steps (median)")
    for name, values in speeds.items():
        print(f"  {name:<34} {statistics.median(values):>8.0f}  ({', '.join(f'{v:.0f}' for v in values)})")
    print(f"  ratio moe / dense: {moe / dense:.3f}")


def load_balance(steps: int, tmp: Path) -> None:
    print(f"\n(c) load imbalance (max / mean tokens per expert, worst layer) after {steps} steps")
    for coeff in (0.01, 0.0):
        rows = _train(["model=moe_tiny", f"model.moe.aux_loss_coeff={coeff}", f"trainer.max_steps={steps}"],
                      tmp / f"balance_{coeff}")
        last = statistics.fmean(r["moe_load_imbalance"] for r in rows[-10:])
        first = statistics.fmean(r["moe_load_imbalance"] for r in rows[:10])
        print(f"  aux_loss_coeff={coeff:<5} first 10 steps {first:.3f}   last 10 steps {last:.3f}   "
              f"final loss {rows[-1]['loss']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of the load-balance runs")
    parser.add_argument("--speed-steps", type=int, default=30, help="training steps of each throughput run")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    all_to_all_volume()
    with tempfile.TemporaryDirectory() as tmp:
        throughput(args.rounds, args.speed_steps, Path(tmp))
        load_balance(args.steps, Path(tmp))


if __name__ == "__main__":
    main()
