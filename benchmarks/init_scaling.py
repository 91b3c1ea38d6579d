"""Initialisation time and peak memory per rank at tp 1, 2, 4 for a Llama 3 70B-shaped model part.

    python benchmarks/init_scaling.py [--part embedding+layer|embedding|layer] [--tp 1 2 4] [--dtype bf16]

The part is Llama 3 70B's shapes (h 8192, ffn 28672 SwiGLU, 64 heads in 8 query groups, RoPE,
RMSNorm, vocabulary 128256 padded per tp): by default the embedding and one layer, as the first
pipeline stage holds them. For each tp, one fresh process is tensor-parallel rank 0 of that tp (on
torch's fake process group: no peers are needed to build and initialise a shard) and materialises
its shard with:

- ``shard``: the package's path (``models.stages.build_model``'s): the model built on the meta
  device, each parameter allocated and filled with only its own elements (``models.init``);
- ``full`` (the previous scheme, re-implemented here as the baseline): the model built with CPU
  storage, then for each parameter the whole logical tensor drawn from a generator seeded by
  (seed, crc32(name)) in fp32, this rank's slice kept and copied in.

Peak memory is the process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``) during
the build and initialisation, less the RSS before it; time is wall and CPU time of the same span
(CPU time is what other jobs on the cores do not inflate). Prints a table with ratios to tp1 and to
the baseline; asserts nothing.

Measured here (torch 2.13 CPU build, ``--threads 1``, other jobs kept the load average at 5-8 on
the 2 cores, so wall times are inflated; 7 minutes in all, about 2 on an idle machine):

     tp method params GiB  peak GiB peak/params  wall s   cpu s peak vs tp1 cpu vs tp1 peak vs full cpu vs full
      1  shard       3.55      3.65        1.03   116.0    48.2        1.00       1.00         0.31        1.18
      1   full       3.55     11.76        3.31    46.9    40.7        1.00       1.00         1.00        1.00
      2  shard       1.78      1.89        1.06    65.8    27.0        0.52       0.56         0.16        0.69
      2   full       1.78     11.76        6.62    71.3    39.4        1.00       0.97         1.00        1.00
      4  shard       0.89      1.01        1.14    32.1    14.8        0.28       0.31         0.09        0.43
      4   full       0.89     11.77       13.24    61.9    34.6        1.00       0.85         1.00        1.00

The shard path's peak is the shard itself plus ~0.1 GiB (the chunk temporaries and the RoPE
tables) and its time falls as 1/tp; the full draw's peak stays at 11.8 GiB (the fp32 embedding
drawn whole) at every tp. At tp1 the hash costs ~1.2x torch's CPU ``randn`` per element.
--part embedding takes about half the time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PARTS = {"embedding+layer": dict(layers=[0]), "embedding": dict(layers=[]), "layer": dict(layers=[0], pre_process=False)}
SEED = 1234


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _config(tp: int, dtype: torch.dtype):
    from megatron_hydra.config.derive import padded_vocab_size
    from megatron_hydra.config.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                             kv_channels=128, ffn_hidden_size=28672, seq_length=8192, max_position_embeddings=8192,
                             vocab_size=128256, padded_vocab_size=padded_vocab_size(128256, 128, tp),
                             position_embedding="rope", rope_theta=500000.0, normalization="rmsnorm",
                             activation="swiglu", add_bias_linear=False, tie_embeddings=False, params_dtype=dtype)


def _full_draw_init(model, cfg, tp_rank: int, tp_size: int) -> None:
    """The baseline: every parameter's whole logical tensor drawn on this rank, its slice kept."""
    from megatron_hydra.models.init import OUTPUT_PROJECTIONS, VOCAB_TABLES

    with torch.no_grad():
        for name, p in model.named_parameters():
            dim = getattr(p, "tp_partition_dim", None)
            shape = list(p.shape)
            if dim is not None:
                shape[dim] *= tp_size
            if name.endswith(".bias") or "norm" in name:
                p.fill_(0.0 if name.endswith(".bias") else 1.0)
                continue
            std = cfg.output_init_std if name.endswith(OUTPUT_PROJECTIONS) else cfg.init_std
            gen = torch.Generator().manual_seed((SEED * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
            rows = cfg.vocab_size if name in VOCAB_TABLES else shape[0]
            full = torch.zeros(shape)
            full[:rows] = torch.randn([rows, *shape[1:]], generator=gen) * std
            p.copy_(full.chunk(tp_size, dim)[tp_rank] if dim is not None else full)
            del full


def measure(method: str, tp: int, part: str, dtype: torch.dtype) -> dict:
    """One configuration in this process: tp rank 0 of ``tp`` materialises its shard."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.models.init import materialize
    from megatron_hydra.parallel.state import ParallelState

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    ps = ParallelState(sizes={"pp": 1, "dp": 1, "cp": 1, "tp": tp}, rank=0, groups={"tp": dist.group.WORLD})
    cfg = _config(tp, dtype)
    stage = dict(PARTS[part], post_process=False)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    if method == "shard":
        model = materialize(GPTModel(cfg, ps, device="meta", **stage), cfg, SEED, 0, tp, "cpu")
    else:
        model = GPTModel(cfg, ps, device="cpu", **stage)
        _full_draw_init(model, cfg, 0, tp)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.destroy_process_group()
    return dict(method=method, tp=tp, wall=wall, cpu=cpu, peak=_status("VmHWM") - before, params=params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=list(PARTS), default="embedding+layer")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "TP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.part, DTYPES[args.dtype])))
        return
    rows = {}
    for tp in args.tp:
        for method in ("shard", "full"):
            cmd = [sys.executable, __file__, "--part", args.part, "--dtype", args.dtype, "--threads",
                   str(args.threads), "--one", method, str(tp)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout
            rows[method, tp] = json.loads(out.strip().splitlines()[-1])
    gib = 2.0 ** 30
    print(f"Llama 3 70B shapes, {args.part}, {args.dtype}, tp rank 0, {args.threads} threads")
    print(f"{'tp':>3} {'method':>6} {'params GiB':>10} {'peak GiB':>9} {'peak/params':>11} {'wall s':>7} {'cpu s':>7}"
          f" {'peak vs tp1':>11} {'cpu vs tp1':>10} {'peak vs full':>12} {'cpu vs full':>11}")
    first = min(args.tp)
    for tp in args.tp:
        for method in ("shard", "full"):
            r, base, full = rows[method, tp], rows[method, first], rows["full", tp]
            print(f"{tp:>3} {method:>6} {r['params'] / gib:>10.2f} {r['peak'] / gib:>9.2f} {r['peak'] / r['params']:>11.2f}"
                  f" {r['wall']:>7.1f} {r['cpu']:>7.1f} {r['peak'] / base['peak']:>11.2f} {r['cpu'] / base['cpu']:>10.2f}"
                  f" {r['peak'] / full['peak']:>12.2f} {r['cpu'] / full['cpu']:>11.2f}")


if __name__ == "__main__":
    main()
