"""Generation throughput of the inference engine at tp1, tp2 and pp2 on CPU, as ratios to tp1.

    python benchmarks/generation_speed.py [prompts=8] [new=32] [batch=8] [threads=1] [cache=1] \
        [hydra overrides, e.g. model=gpt_125m]

Each layout starts its own gloo ranks, builds its model stage as a generation job does
(``models.stages``, weights from the seed: the same logical model at every layout), generates once
to warm up, then times ``Engine.generate``: greedy, prompts of different lengths (left-padded in
one batch), ``new`` tokens each (no end-of-document stop). tokens/s counts the new tokens of all
prompts over the wall time of rank 0's call. pp2 keeps two micro-batches in flight (of up to
``batch`` prompts each, fewer when there are too few prompts to fill both), and its last stage also
holds the LM head: with a large vocabulary that stage bounds the speed-up
(``parallel.layers_per_stage`` can give it fewer layers). On a machine with fewer free cores than
ranks the ranks share cores: read tp2 and pp2 from a machine with >= 2 free cores per thread
setting. Prints, asserts nothing.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"tp1": dict(tp=1, pp=1), "tp2": dict(tp=2, pp=1), "pp2": dict(tp=1, pp=2)}
DEFAULTS = {"prompts": 8, "new": 32, "batch": 8, "threads": 1, "cache": 1}


def _config(tp: int, pp: int, overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megatron_hydra.config import register_configs
    from megatron_hydra.config.machine import resolve

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[
            "run_dir=unused", "model=gpt_tiny", "data=synthetic", f"parallel.tensor_parallel_size={tp}",
            f"parallel.pipeline_parallel_size={pp}", f"trainer.devices={tp * pp}", "data.micro_batch_size=1",
            "data.global_batch_size=8", *overrides])
    return resolve(OmegaConf.to_object(cfg), visible_gpus=0)


def _prompts(n: int, vocab: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (16 + (17 * i) % 33,), generator=gen).tolist() for i in range(n)]


def _rank(rank, world, port, layout, args, overrides, out):
    import torch.distributed as dist

    from megatron_hydra.config import derive
    from megatron_hydra.config.schema import SamplingConfig
    from megatron_hydra.inference.engine import Engine
    from megatron_hydra.models.stages import build_stage_chunks
    from megatron_hydra.parallel.state import ParallelState

    torch.set_num_threads(args["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = _config(layout["tp"], layout["pp"], overrides)
        derived = derive(cfg)
        ps = ParallelState.build(tp=layout["tp"], pp=layout["pp"])
        chunks, _ = build_stage_chunks(cfg, derived, ps)
        engine = Engine(chunks, ps, derived.transformer, batch_size=args["batch"])
        prompts = _prompts(args["prompts"], derived.transformer.vocab_size)
        greedy, cache = SamplingConfig(greedy=True), bool(args["cache"])
        engine.generate(prompts, 2, greedy, use_cache=cache)  # warm-up
        dist.barrier()
        start = time.perf_counter()
        tokens = engine.generate(prompts, args["new"], greedy, use_cache=cache)
        elapsed = time.perf_counter() - start
        if rank == 0:
            out.put((sum(len(t) for t in tokens), elapsed, derived.transformer.num_layers,
                     derived.transformer.hidden_size))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo ranks that used point-to-point ops can abort in interpreter teardown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(name: str, args, overrides):
    layout = LAYOUTS[name]
    world = layout["tp"] * layout["pp"]
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(world, _free_port(), layout, args, overrides, out), nprocs=world,
                       start_method="spawn")
    return out.get()


def main(argv) -> None:
    args, overrides = dict(DEFAULTS), []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in DEFAULTS:
            args[key] = int(value)
        else:
            overrides.append(arg)
    results = {name: measure(name, args, overrides) for name in LAYOUTS}
    tokens, _, layers, hidden = results["tp1"]
    print(f"{args['prompts']} prompts of 16-48 tokens, {args['new']} new tokens each ({tokens} in all), "
          f"{layers} layers x hidden {hidden}, batch {args['batch']}, {args['threads']} thread(s) per rank, "
          f"KV cache {'on' if args['cache'] else 'off'}")
    base = results["tp1"][0] / results["tp1"][1]
    print(f"{'layout':<8}{'ranks':>6}{'seconds':>10}{'tokens/s':>10}{'vs tp1':>8}")
    for name, (count, elapsed, _, _) in results.items():
        layout = LAYOUTS[name]
        rate = count / elapsed
        print(f"{name:<8}{layout['tp'] * layout['pp']:>6}{elapsed:>10.2f}{rate:>10.1f}{rate / base:>8.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
