"""The layout planner against Narayanan et al. 2021 (SC21), Table 1.

For each published row (GPT 1.7B .. 1T on up to 3072 A100s): the published TFLOP/s per GPU, the
performance model's prediction for the published layout and its relative error; then the
planner's own best layout on the same GPUs, global batch and software features as the 2021 runs
(full recompute, no sequence parallelism, no distributed optimizer, no overlapped gradient
reduction), and whether that is the published layout or one it predicts to be faster (by how much).
Also refits the two free constants and prints them next to the ones the planner ships with.

    python benchmarks/planner_sc21.py            # all rows (about a minute: memory plans)
    python benchmarks/planner_sc21.py --no-search  # prediction errors only (seconds)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from megatron_hydra.config import register_configs  # noqa: E402
from megatron_hydra.config.machine import resolve  # noqa: E402
from megatron_hydra.planning import sc21  # noqa: E402
from megatron_hydra.planning.layouts import Options, describe, plan_layouts  # noqa: E402
from megatron_hydra.planning.performance import CALIBRATED, estimate  # noqa: E402

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
SC21_FEATURES = Options(recompute=("full",), sequence_parallel=(False,), distributed_optimizer=(False,),
                        data_parallel=("ddp",), overlap_grad_reduce=False, flash_attention=False)


def row_config(row: sc21.SC21Row):
    """The run config of a row: its model and batch on a Selene-like cluster of its GPU count."""
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose(config_name="config", overrides=[
            "run_dir=unused", "cluster=a100_80g_x1024", f"cluster.num_nodes={row.gpus // 8}", "data=synthetic",
            *sc21.model_overrides(row)])
    return resolve(OmegaConf.to_object(cfg), visible_gpus=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-search", action="store_true", help="skip the planner's search over layouts")
    args = parser.parse_args()
    cluster = row_config(sc21.TABLE1[0]).cluster
    eta, kappa, rms = sc21.fit(cluster)
    print(f"fitted constants: eta={eta:.3f} kappa={kappa:.3f} (rms error {rms:.1%}); "
          f"shipped: eta={CALIBRATED.eta:.3f} kappa={CALIBRATED.kappa:.3f}")
    header = f"{'model':>7} {'t':>2} {'p':>3} {'d':>3} {'GPUs':>5} {'pub':>5} {'pred':>6} {'error':>7}"
    if not args.no_search:
        header += f"  {'planner top (SC21 features)':<40} {'pred':>6} {'vs pub':>7} {'fits':>5} {'s':>5}"
    print(header)
    worst = 0.0
    for row in sc21.TABLE1:
        pred = sc21.predicted_tflops(row, cluster)
        error = pred / row.tflops_per_gpu - 1
        worst = max(worst, abs(error))
        line = (f"{row.label:>7} {row.tp:>2} {row.pp:>3} {row.dp:>3} {row.gpus:>5} {row.tflops_per_gpu:>5.0f} "
                f"{pred:>6.1f} {error:>+7.1%}")
        if not args.no_search:
            cfg = row_config(row)
            start = time.perf_counter()
            found = plan_layouts(cfg, cfg.cluster, SC21_FEATURES)
            elapsed = time.perf_counter() - start
            published = sc21.published_layout(row)
            pub_step = estimate(sc21.transformer(row), row.batch, published, cluster).total
            fits = any(c.layout == published for c in found)
            if found:
                top = found[0]
                same = (top.layout.tp, top.layout.pp) == (row.tp, row.pp)
                name = ("= published t,p; " if same else "") + describe(top.layout).replace(" recompute=full", "")
                line += (f"  {name:<40} {top.step.tflops_per_gpu:>6.1f} {pub_step / top.step.total - 1:>+7.1%} "
                         f"{'yes' if fits else 'NO':>5} {elapsed:>5.1f}")
            else:
                line += "  (no layout fits)"
        print(line, flush=True)
    print(f"largest |error| of predicted TFLOP/s per GPU for the published layouts: {worst:.1%}")
    if not args.no_search:
        print("'vs pub': predicted speed-up of the planner's top layout over the published one (micro-batch 1, "
              "no interleaving); 'fits': the published layout passes the memory plan")


if __name__ == "__main__":
    main()
