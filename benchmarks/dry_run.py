"""Dry run of three large GPU jobs on this CPU: wall time per simulated rank, and measured bytes
per rank position against ``mode=plan``.

For each layout the dry run (``megatron_hydra.training.dry_run``) runs one training step of its
default rank positions on torch's fake process group and fake GPU tensors. Printed per rank: the
state after the step (weights, grads, fp32 main weights, optimizer state, pipeline buffers; target
within 10% of the plan), the step's peak above it (activations and temporaries, beside the plan's
activations), the peak while the checkpoint is planned, and the seconds the rank took.

    python benchmarks/dry_run.py            # the three layouts, every default rank position
    python benchmarks/dry_run.py --quick    # first and last pipeline rank only
"""

from __future__ import annotations

import argparse
import time

from megatron_hydra.config import derive
from megatron_hydra.config.bundled import compose
from megatron_hydra.training.dry_run import default_ranks, dry_run, table

LAYOUTS = {
    "gpt_175b tp8 pp16 dp8 (1024 GPUs)": ["model=gpt_175b", "parallel=tp8_pp16", "trainer.num_nodes=128",
                                          "data.micro_batch_size=1", "data.global_batch_size=128"],
    "llama3_70b tp8 pp4 dp4 (128 GPUs)": ["model=llama3_70b", "parallel=tp8_pp4", "trainer.num_nodes=16",
                                          "data.micro_batch_size=1", "data.global_batch_size=16"],
    "gpt_8b tp4 pp2 dp4 (32 GPUs)": ["model=gpt_8b", "parallel=tp4_pp2", "trainer.num_nodes=4",
                                     "data.micro_batch_size=1", "data.global_batch_size=16"],
}
COMMON = ["trainer=gpu", "trainer.devices=8", "data=synthetic", "precision=bf16", "optim.distributed_optimizer=true"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="first and last pipeline rank only")
    args = parser.parse_args()
    for name, overrides in LAYOUTS.items():
        cfg = compose(COMMON + overrides)
        derived = derive(cfg)
        ranks = default_ranks(derived, True)
        if args.quick:
            ranks = [ranks[0], ranks[-1]]
        start = time.perf_counter()
        results = dry_run(cfg, derived, ranks)
        print(f"\n== {name}: {len(ranks)} ranks simulated in {time.perf_counter() - start:.1f} s")
        print(table(cfg, derived, results))


if __name__ == "__main__":
    main()
