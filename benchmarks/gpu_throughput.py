"""Training throughput of gpt_1.3b in bf16 on one GPU: tokens/s and MFU, local layers and (when
Transformer Engine is installed) ``model.transformer_impl=transformer_engine``.

Each variant is one ``launch.py`` run on synthetic data; the figures are medians over the steps
after the first few (compilation, allocator warm-up), read from the run's ``csv/metrics.csv``.
MFU is the run's own metric (model FLOPs per step over the device's dense bf16 peak). Without a
CUDA device this prints why and exits 0, so ``scripts/gpu_check.sh`` can run it anywhere.

    python benchmarks/gpu_throughput.py [--steps 30] [--model gpt_1.3b]
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 5


def run(model: str, steps: int, impl: str, run_dir: str) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "launch.py"), f"model={model}", "trainer=gpu", "trainer.devices=1",
           "precision=bf16", "data=synthetic", "data.micro_batch_size=4", "data.global_batch_size=8",
           f"trainer.max_steps={steps}", "checkpoint.save_last=false", "trainer.enable_progress_bar=false",
           "trainer.generate_sample_tokens=0", f"model.transformer_impl={impl}", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]}
    with open(os.path.join(run_dir, "csv", "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("tokens_per_s")]
    rows = rows[WARMUP:] or rows
    out = {"tokens_per_s": statistics.median(float(r["tokens_per_s"]) for r in rows)}
    if rows and rows[0].get("mfu"):
        out["mfu"] = statistics.median(float(r["mfu"]) for r in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default="gpt_1.3b")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device, nothing measured")
        return
    impls = ["local"] + (["transformer_engine"] if importlib.util.find_spec("transformer_engine") else [])
    print(f"{args.model} bf16 on one {torch.cuda.get_device_name()}, micro-batch 4, {args.steps} steps")
    print(f"{'impl':<20}{'tokens/s':>12}{'MFU %':>8}")
    for impl in impls:
        with tempfile.TemporaryDirectory() as tmp:
            r = run(args.model, args.steps, impl, tmp)
        if "error" in r:
            print(f"{impl:<20} failed: {r['error']}")
        else:
            mfu = f"{r['mfu']:.1f}" if "mfu" in r else "-"
            print(f"{impl:<20}{r['tokens_per_s']:>12.0f}{mfu:>8}")


if __name__ == "__main__":
    main()
