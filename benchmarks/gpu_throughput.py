"""Training throughput of gpt_1.3b in bf16 on one GPU: tokens/s and MFU, local layers eager and
compiled (``trainer.compile=true``: each block through inductor, with its cold-compile time) and
(when Transformer Engine is installed) ``model.transformer_impl=transformer_engine``. The compiled
row against the eager one is the measurement that ``trainer.compile``'s GPU default waits for.

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
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 5
# variant: (model.transformer_impl, extra overrides)
VARIANTS = {"local": ("local", []), "local compiled": ("local", ["trainer.compile=true"]),
            "transformer_engine": ("transformer_engine", [])}
COLD = re.compile(r"compiled \d+ blocks \(\w+\) in ([0-9.]+) s")
RUN_TIMEOUT_S = 150  # a compile that takes longer is reported, not waited for


def run(model: str, steps: int, impl: str, run_dir: str, extra=()) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "launch.py"), f"model={model}", "trainer=gpu", "trainer.devices=1",
           "precision=bf16", "data=synthetic", "data.micro_batch_size=4", "data.global_batch_size=8",
           f"trainer.max_steps={steps}", "checkpoint.save_last=false", "trainer.enable_progress_bar=false",
           "trainer.generate_sample_tokens=0", f"model.transformer_impl={impl}", f"hydra.run.dir={run_dir}", *extra]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {RUN_TIMEOUT_S} s"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]}
    with open(os.path.join(run_dir, "csv", "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("tokens_per_s")]
    rows = rows[WARMUP:] or rows
    out = {"tokens_per_s": statistics.median(float(r["tokens_per_s"]) for r in rows)}
    cold = COLD.search(done.stdout + done.stderr)
    if cold:
        out["cold_s"] = float(cold.group(1))
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
    names = [n for n in VARIANTS if n != "transformer_engine" or importlib.util.find_spec("transformer_engine")]
    print(f"{args.model} bf16 on one {torch.cuda.get_device_name()}, micro-batch 4, {args.steps} steps")
    print(f"{'variant':<20}{'tokens/s':>12}{'MFU %':>8}{'x eager':>9}{'cold compile s':>16}")
    eager = None
    for name in names:
        impl, extra = VARIANTS[name]
        with tempfile.TemporaryDirectory() as tmp:
            r = run(args.model, args.steps, impl, tmp, extra)
        if "error" in r:
            print(f"{name:<20} failed: {r['error']}")
            continue
        eager = eager or (r["tokens_per_s"] if name == "local" else None)
        mfu = f"{r['mfu']:.1f}" if "mfu" in r else "-"
        ratio = f"{r['tokens_per_s'] / eager:.2f}" if eager else "-"
        cold = f"{r['cold_s']:.1f}" if "cold_s" in r else "-"
        print(f"{name:<20}{r['tokens_per_s']:>12.0f}{mfu:>8}{ratio:>9}{cold:>16}")


if __name__ == "__main__":
    main()
